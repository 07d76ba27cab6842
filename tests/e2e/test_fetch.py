"""model.hfUri and data.tokenizerUri through `kubetrain run` on a real S3 server (S3Proxy, tests/support/objectstore.py): a
tiny Llama and its BPE tokenizer, built here and uploaded, are fetched into the run's cache before the 2 workers
start, trained, and reported (progress.json's fetch record); a second run on the same output directory downloads
nothing; a bucket that does not exist fails the job at once with the fetch step's configuration error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.hf_models import bpe_tokenizer, tiny_causal_lm
from support.objectstore import REGION, ObjectStore
from support.paths import EXAMPLE_DATA
from support.trainer_harness import run_cli, tiny_spec

pytestmark = pytest.mark.e2e
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

STEPS = 6


def upload(store: ObjectStore, local: Path, prefix: str) -> None:
    fs = store.filesystem()
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.put_file(str(path), store.url(prefix, path.relative_to(local).as_posix()))


def run(tmp: Path, name: str, store: ObjectStore, model_uri: str, out: Path) -> tuple[int, str, dict[str, Any]]:
    spec = tiny_spec(maxSteps=STEPS, workers=2, model={"hfUri": model_uri, "seqLen": 32},
                     data={"tokenizerUri": store.url("tok")}, s3={"endpoint": store.endpoint_url, "region": REGION})
    manifest = tmp / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                        "metadata": {"name": name}, "spec": spec}))
    keys = {"AWS_ACCESS_KEY_ID": store.access_key, "AWS_SECRET_ACCESS_KEY": store.secret_key}
    r = run_cli(["run", str(manifest), "--output-dir", str(out)], env=keys, timeout=300)
    return r.returncode, r.stdout + r.stderr, json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(object_store_server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    store: ObjectStore = object_store_server.new_bucket()
    tmp = tmp_path_factory.mktemp("fetch")
    vocab = bpe_tokenizer(tmp / "tok", sorted(EXAMPLE_DATA.glob("*.txt")))
    tiny_causal_lm(tmp / "model", vocab_size=vocab)
    upload(store, tmp / "model", "models/llama")
    upload(store, tmp / "tok", "tok")
    out = tmp / "out"
    done: dict[str, Any] = {"first": run(tmp, "fetched", store, store.url("models/llama"), out)}
    done["progress"] = json.loads((out / "progress.json").read_text())
    weights = next((out / "cache" / "model").glob("*.safetensors"))
    done["weights_before"] = weights.stat().st_mtime_ns
    done["second"] = run(tmp, "fetched", store, store.url("models/llama"), out)
    done["weights_after"] = weights.stat().st_mtime_ns
    done["fetch_log"] = (out / "logs" / "gen-0" / "fetch.log").read_text()
    done["wrong"] = run(tmp, "wrong-bucket", store, "s3://no-such-bucket-kubetrain/models/llama", tmp / "wrong")
    done["out"] = out
    return done


def test_a_model_and_tokenizer_from_the_bucket_are_fetched_and_trained(runs: dict[str, Any]) -> None:
    code, output, summary = runs["first"]
    assert code == 0, output[-4000:]
    assert summary["phase"] == "Succeeded" and summary["steps"] == STEPS, summary
    assert summary["final_loss"] < summary["initial_loss"]
    fetch = runs["progress"]["fetch"]
    assert fetch["done"] is True and fetch["bytes"] == fetch["totalBytes"] > 0, fetch
    cache = runs["out"] / "cache"
    assert (cache / "model" / "config.json").is_file() and (cache / "tokenizer" / "tokenizer.json").is_file()


def test_a_second_run_on_the_same_output_directory_downloads_nothing(runs: dict[str, Any]) -> None:
    code, output, summary = runs["second"]
    assert code == 0 and summary["phase"] == "Succeeded", output[-4000:]
    assert runs["weights_after"] == runs["weights_before"]  # the cached file was not written again
    assert runs["fetch_log"].count("is in the cache already") == 2, runs["fetch_log"]


def test_a_bucket_that_does_not_exist_fails_the_job_naming_model_hf_uri(runs: dict[str, Any]) -> None:
    code, output, summary = runs["wrong"]
    assert code != 0 and summary["phase"] == "Failed" and summary["restarts"] == 0, output[-4000:]
    said = ("worker 0's fetch exited with code 2 (configuration error: model.hfUri: s3://no-such-bucket-kubetrain/models/llama: "
            "the bucket does not exist")
    assert said in summary["message"], summary["message"]
    assert said.split("(", 1)[1] in output
