"""checkpoint.uri's pure policies (trainer checkpoint/object_store.py): the client options, what a commit prunes, and which
errors stop the job instead of restarting it."""

from __future__ import annotations

import pytest

from kubetrain.core.api import S3Spec
from kubetrain.trainer.checkpoint.object_store import parse_step, steps_to_delete
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data.s3 import require_bucket, s3_options, store_error


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
    (type("InvalidEndpointError", (Exception,), {})("Invalid endpoint: http//x"), "cannot be reached or addressed"),
])
def test_errors_no_restart_cures_name_the_uri(exc: Exception, words: str) -> None:
    err = store_error(exc, "checkpoint.uri", "s3://bkt/runs")
    assert isinstance(err, ConfigError) and err.field == "checkpoint.uri"
    assert "s3://bkt/runs" in err.message and words in err.message


def _error(kind: str) -> Exception:
    return type(kind, (Exception,), {})(f"{kind} on endpoint URL")


@pytest.mark.parametrize("kind", ["EndpointConnectionError", "ConnectTimeoutError"])
def test_a_store_lost_after_first_contact_is_an_outage_a_restart_outlives(kind: str) -> None:
    assert store_error(_error(kind), "checkpoint.uri", "s3://bkt") is None
    err = store_error(_error(kind), "checkpoint.uri", "s3://bkt", first_contact=True)
    assert err is not None and "cannot be reached" in err.message and kind in err.message


class _Store:
    """head_bucket answers with the queued errors, then succeeds; the clock moves only when the caller sleeps."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.asked, self.now = list(errors), 0, 0.0

    def call_s3(self, method: str, **kwargs: str) -> None:
        assert (method, kwargs) == ("head_bucket", {"Bucket": "bkt"})
        self.asked += 1
        if self.errors:
            raise self.errors.pop(0)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_first_contact_waits_out_a_store_that_cannot_be_reached_yet() -> None:
    store = _Store(_error("ConnectTimeoutError"), _error("EndpointConnectionError"))
    require_bucket(store, "checkpoint.uri", "s3://bkt/run", wait_s=60, clock=lambda: store.now, sleep=store.sleep)
    assert store.asked == 3 and 0 < store.now <= 60


def test_first_contact_names_the_field_once_the_wait_is_over() -> None:
    store = _Store(*[_error("ConnectTimeoutError")] * 100)
    with pytest.raises(ConfigError, match="cannot be reached or addressed") as raised:
        require_bucket(store, "data.uri", "s3://bkt/x", wait_s=30, clock=lambda: store.now, sleep=store.sleep)
    assert raised.value.field == "data.uri" and store.now >= 30 and store.asked < 100


def test_first_contact_does_not_wait_for_a_bucket_that_does_not_exist() -> None:
    store = _Store(FileNotFoundError("NoSuchBucket"))
    with pytest.raises(ConfigError, match="bucket does not exist"):
        require_bucket(store, "checkpoint.uri", "s3://bkt/run", wait_s=60, clock=lambda: store.now, sleep=store.sleep)
    assert (store.asked, store.now) == (1, 0.0)


def test_transient_errors_restart_the_gang() -> None:
    assert store_error(TimeoutError("read timed out"), "checkpoint.uri", "s3://bkt") is None
    assert store_error(FileNotFoundError("step-00000010/COMMITTED"), "checkpoint.uri", "s3://bkt") is None
