"""The fetch step's pure parts (kubetrain.trainer.data.fetch): the listing under a URI, the marker that makes a
second fetch a no-op, who reports, and the spec the trainer runs once the cache holds the model and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kubetrain.core import contract
from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data.fetch import (
    MARKER,
    Listing,
    check_listing,
    is_fetched,
    local_path,
    relative_objects,
    resolved,
    should_report,
)

URI = "s3://models/llama/v1"


def info(size: int, etag: str = '"e"', kind: str = "file") -> dict[str, Any]:
    return {"size": size, "ETag": etag, "type": kind}


def test_the_listing_keeps_keys_relative_to_the_uri_and_only_its_objects() -> None:
    found = {
        "models/llama/v1/config.json": info(10, '"a"'),
        "models/llama/v1/sub/dir/model.safetensors": info(300, '"b"'),
        "models/llama/v1/empty-folder/": info(0),
        "models/llama/v1/folder": info(0, kind="directory"),
        "models/llama/v10/config.json": info(7),  # a sibling prefix, not under the URI
    }
    assert relative_objects("model.hfUri", URI + "/", found) == {
        "config.json": (10, '"a"'), "sub/dir/model.safetensors": (300, '"b"')}
    assert local_path(Path("/c/model"), "sub/dir/model.safetensors") == Path("/c/model/sub/dir/model.safetensors")


@pytest.mark.parametrize("key", ["models/llama/v1/../escape", "models/llama/v1/a//b", "models/llama/v1/./x"])
def test_a_key_that_would_leave_the_cache_directory_is_refused(key: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.hfUri: s3://models/llama/v1: the object key"):
        relative_objects("model.hfUri", URI, {key: info(1)})


def test_an_empty_prefix_and_a_model_without_config_are_configuration_errors() -> None:
    with pytest.raises(ConfigError, match=r"^data\.tokenizerUri: no objects under s3://models/tok$"):
        check_listing(Listing("data.tokenizerUri", "s3://models/tok", {}))
    with pytest.raises(ConfigError, match=r"model\.hfUri: s3://models/llama/v1: no config\.json among its 1 object"):
        check_listing(Listing("model.hfUri", URI, {"model.safetensors": (5, "x")}))
    check_listing(Listing("data.tokenizerUri", "s3://models/tok", {"tokenizer.json": (5, "x")}))  # no config needed


def test_the_marker_matches_only_the_same_listing(tmp_path: Path) -> None:
    listing = Listing("model.hfUri", URI, {"config.json": (10, '"a"'), "w.safetensors": (300, '"b"')})
    assert not is_fetched(tmp_path, listing)
    (tmp_path / MARKER).write_text(json.dumps(listing.marker()))
    assert is_fetched(tmp_path, listing)
    assert listing.total == 310
    for changed in ({"config.json": (10, '"a"'), "w.safetensors": (300, '"c"')},  # new ETag
                    {"config.json": (10, '"a"'), "w.safetensors": (301, '"b"')},  # new size
                    {"config.json": (10, '"a"')}):  # an object gone
        assert not is_fetched(tmp_path, Listing("model.hfUri", URI, changed))
    assert not is_fetched(tmp_path, Listing("model.hfUri", URI + "2", listing.objects))
    (tmp_path / MARKER).write_text("{torn")
    assert not is_fetched(tmp_path, listing)


@pytest.mark.parametrize(("env", "reports"), [
    ({}, True),
    ({contract.NODE_RANK: "0"}, True),  # a worker of several processes: its launcher gives the ranks
    ({contract.NODE_RANK: "0", contract.RANK: "0"}, True),
    ({contract.NODE_RANK: "1"}, False),
    ({contract.NODE_RANK: "1", contract.RANK: "1"}, False),
    ({contract.NODE_RANK: "0", contract.RANK: "1"}, False),
])
def test_only_worker_zero_reports(env: dict[str, str], reports: bool) -> None:
    assert should_report(env) is reports


def spec(**model_data: Any) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({"model": model_data.get("model", {}), "data": model_data.get("data", {})})


def mark(directory: Path, uri: str) -> None:
    directory.mkdir(parents=True)
    (directory / MARKER).write_text(json.dumps({"uri": uri, "objects": {}}))


def test_resolved_points_the_trainer_at_the_cache(tmp_path: Path) -> None:
    s = spec(model={"hfUri": URI}, data={"tokenizerUri": "s3://models/tok"})
    mark(tmp_path / "model", URI)
    mark(tmp_path / "tokenizer", "s3://models/tok")
    r = resolved(s, tmp_path)
    assert (r.model.hf_path, r.model.hf_uri) == (str(tmp_path / "model"), None)
    assert (r.data.tokenizer, r.data.tokenizer_uri) == (str(tmp_path / "tokenizer"), None)
    assert r.rule_violations() == [] and r.model.is_hf()
    plain = spec(model={"hfPath": "/m"})
    assert resolved(plain, None) is plain


def test_resolved_refuses_a_cache_the_fetch_step_did_not_fill(tmp_path: Path) -> None:
    s = spec(model={"hfUri": URI}, data={"tokenizerUri": "s3://models/tok"})
    mark(tmp_path / "model", URI)
    with pytest.raises(ConfigError, match=r"^data\.tokenizerUri: s3://models/tok is not in the cache .*did not run"):
        resolved(s, tmp_path)
    mark(tmp_path / "tokenizer", "s3://models/other")  # another URI's copy
    with pytest.raises(ConfigError, match=r"^data\.tokenizerUri: "):
        resolved(s, tmp_path)
    with pytest.raises(ConfigError, match=rf"^{contract.CACHE_DIR}: not set"):
        resolved(s, None)
