"""checkpoint.uri's pure policies (trainer checkpoint/object_store.py): the client options, what a commit prunes, and which
errors stop the job instead of restarting it."""

from __future__ import annotations

import pytest

from kubetrain.core.api import S3Spec
from kubetrain.trainer.checkpoint.object_store import parse_step, steps_to_delete
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data.s3 import s3_options, store_error


@pytest.mark.parametrize(("s3", "style", "endpoint", "region"), [
    (None, "virtual", None, None),  # AWS: the SDK's default chain finds region and credentials
    ({"endpoint": "http://seaweed:8333"}, "path", "http://seaweed:8333", None),
    ({"endpoint": "https://storage.googleapis.com", "region": "auto", "addressingStyle": "virtual"},
     "virtual", "https://storage.googleapis.com", "auto"),
    ({"region": "eu-west-1", "addressingStyle": "path"}, "path", None, "eu-west-1"),
])
def test_client_options_follow_checkpoint_s3(s3, style, endpoint, region) -> None:
    opts = s3_options(S3Spec.model_validate(s3) if s3 is not None else None)
    assert opts["config_kwargs"]["s3"] == {"addressing_style": style}
    assert opts["endpoint_url"] == endpoint
    assert opts["client_kwargs"].get("region_name") == region
    assert opts["config_kwargs"]["retries"]["max_attempts"] <= 3  # fails within seconds, no retry storm
    assert opts["use_listings_cache"] is False  # other ranks write: never a stale listing
    assert not {"key", "secret"} & set(opts)  # credentials: the environment's, never the spec's


@pytest.mark.parametrize(("steps", "keep", "best", "doomed"), [
    ({10: True, 20: True, 30: True}, 2, None, [10]),
    ({10: True, 20: True, 30: True}, 1, 10, [20]),  # the best evaluation's checkpoint stays
    ({10: True, 15: False, 20: True, 25: False}, 3, None, [15]),  # torn older than the newest: gone
    ({10: False, 20: False}, 3, None, []),  # nothing committed: nothing to judge torn steps by
    ({}, 3, None, []),
])
def test_a_commit_prunes_old_and_torn_steps(steps, keep, best, doomed) -> None:
    assert steps_to_delete(steps, keep, best) == doomed


def test_only_step_directories_are_steps() -> None:
    assert parse_step("bkt/runs/step-00000020/") == 20
    assert parse_step("bkt/runs/best-eval.json") is None and parse_step("step-12x") is None


@pytest.mark.parametrize(("exc", "words"), [
    (PermissionError("An error occurred (SignatureDoesNotMatch)"), "credentials were refused"),
    (FileNotFoundError("The specified bucket does not exist"), "bucket does not exist"),
    (type("EndpointConnectionError", (Exception,), {})("Could not connect"), "cannot be reached"),
])
def test_errors_no_restart_cures_name_the_uri(exc: Exception, words: str) -> None:
    err = store_error(exc, "checkpoint.uri", "s3://bkt/runs")
    assert isinstance(err, ConfigError) and err.field == "checkpoint.uri"
    assert "s3://bkt/runs" in err.message and words in err.message


def test_transient_errors_restart_the_gang() -> None:
    assert store_error(TimeoutError("read timed out"), "checkpoint.uri", "s3://bkt") is None
    assert store_error(FileNotFoundError("step-00000010/COMMITTED"), "checkpoint.uri", "s3://bkt") is None
