"""data.uri: training data streamed from S3-compatible object storage (a real S3 server, S3Proxy: tests/support/
objectstore.py), 2 gloo processes on CPU.

The example text, tokenized with the byte tokenizer, is uploaded as three uint16 `.bin` shards and one text
shard; 8 steps read more samples than one epoch holds, so the stream wraps into a reshuffled epoch. A gang
killed after step 6 resumes from its step-4 checkpoint and trains on exactly the samples of an uninterrupted
run: every step's loss after the resume equals that run's. Evaluation reads data.evalPath's local text.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.objectstore import REGION, ObjectStore, ObjectStoreServer
from support.paths import EXAMPLE_DATA
from support.trainer_harness import Gang, rel_diff, tiny_spec

from kubetrain.core.contract import FAIL_AT
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data.stream import PREFETCH, list_objects

pytestmark = pytest.mark.e2e

STEPS = 8
SHARD_BYTES = 330
"""Each shard holds (330 - 1) // 32 = 10 windows: 20 per rank and epoch, and each rank reads 4 per step."""


def upload_shards(store: ObjectStore, prefix: str) -> None:
    text = (EXAMPLE_DATA / "licenses.txt").read_bytes()
    fs = store.filesystem()
    for i in range(4):
        part = text[i * SHARD_BYTES : (i + 1) * SHARD_BYTES]
        if i == 2:
            fs.pipe(store.url(prefix, f"shard-{i}.txt"), part)
        else:
            fs.pipe(store.url(prefix, f"shard-{i}.bin"), np.frombuffer(part, np.uint8).astype("<u2").tobytes())
    fs.pipe(store.url(prefix, "README.md"), b"not a shard")


def spec(store: ObjectStore, prefix: str) -> dict[str, Any]:
    return tiny_spec(maxSteps=STEPS, checkpoint={"everySteps": 4, "keep": 2, "asyncSave": False}, evalEverySteps=4,
                     data={"uri": store.url(prefix), "glob": "shard-*", "evalPath": str(EXAMPLE_DATA / "README.md")},
                     s3={"endpoint": store.endpoint_url, "region": REGION})


@pytest.fixture(scope="module")
def runs(object_store_server: ObjectStoreServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    store = object_store_server.new_bucket()
    upload_shards(store, "corpus")
    root = tmp_path_factory.mktemp("data-uri")
    keys = {"AWS_ACCESS_KEY_ID": store.access_key, "AWS_SECRET_ACCESS_KEY": store.secret_key}
    whole = Gang(root / "whole", spec(store, "corpus"), env=keys)
    killed = Gang(root / "killed", spec(store, "corpus"), env={**keys, FAIL_AT: "1:6"})
    done: dict[str, Any] = {"store": store, "whole": whole.wait(), "killed": killed.wait()}
    done["resumed"] = Gang(root / "killed", spec(store, "corpus"), env=keys, generation=1).wait()
    return done


def test_a_resumed_gang_streams_the_samples_of_an_uninterrupted_run(runs: dict[str, Any]) -> None:
    whole, killed, resumed = runs["whole"], runs["killed"], runs["resumed"]
    assert whole.exit_codes == [0, 0], whole.log(0)[-3000:] + whole.log(1)[-3000:]
    assert killed.exit_codes[1] == 137, killed.log(1)[-3000:]
    assert resumed.exit_codes == [0, 0], resumed.log(0)[-3000:] + resumed.log(1)[-3000:]
    assert resumed.progress["resumedFrom"] == 4
    again = {r["step"]: r["loss"] for r in resumed.records if r["generation"] == 1}
    assert sorted(again) == list(range(5, STEPS + 1))
    assert rel_diff(again, whole.losses) <= 1e-6
    evals = whole.per_step("eval_loss")  # from data.evalPath's text
    assert sorted(evals) == [4, 8] and rel_diff(resumed.per_step("eval_loss"), evals) <= 1e-6
    for rank in (0, 1):  # the cache keeps the shard being read and the next ones, no partial download
        cached = sorted(p.name for p in (whole.out / "cache" / "data" / f"rank-{rank:05d}").iterdir())
        assert 1 <= len(cached) <= PREFETCH + 1 and not [n for n in cached if n.endswith(".part")], cached


def test_refused_credentials_are_a_config_error_naming_data_uri(runs: dict[str, Any]) -> None:
    store: ObjectStore = runs["store"]
    with pytest.raises(ConfigError) as err:
        list_objects(store.filesystem(secret_key="wrong-secret"), store.url("corpus"))
    assert err.value.field == "data.uri" and "credentials were refused" in err.value.message
