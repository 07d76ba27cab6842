"""checkpoint.uri: durable checkpoints in S3-compatible object storage (a real S3 server, S3Proxy: tests/support/
objectstore.py), 2 gloo processes on CPU, fsdp with background saves.

- A gang killed while a background write is in flight resumes, in its next generation, from the newest step
  COMMITTED in the bucket, never from a newer step whose COMMITTED is missing (one planted: a committed step's
  files under a newer step's name), removes that torn step, and ends with the loss of an uninterrupted run;
  keep prunes the bucket.
- A wrong secret stops the gang at once with exit 2 and a message naming checkpoint.uri.

The endpoint, region and addressing style come from spec.s3 only; the processes get just the keys.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.objectstore import REGION, ObjectStore, ObjectStoreServer
from support.trainer_harness import Gang, Run, rel_diff, tiny_spec
from support.waiting import wait_for

from kubetrain.core.contract import CONFIG_ERROR_EXIT_CODE
from kubetrain.core.progress import COMMIT_MARKER
from kubetrain.trainer.checkpoint.background import WRITE_DELAY_ENV

pytestmark = pytest.mark.e2e

STEPS = 8
EVERY = 2
TORN_STEP = 4
"""The save in flight when rank 1 is killed."""
PLANTED = 6
"""A step newer than any committed one, planted with every file but COMMITTED."""


def spec(store: ObjectStore, prefix: str) -> dict[str, Any]:
    s3 = {"endpoint": store.endpoint_url, "region": REGION}
    return tiny_spec(strategy="fsdp", maxSteps=STEPS,
                     checkpoint={"everySteps": EVERY, "keep": 2, "asyncSave": True, "uri": store.url(prefix)}, s3=s3)


def keys(store: ObjectStore, secret: str | None = None) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": store.access_key, "AWS_SECRET_ACCESS_KEY": secret or store.secret_key}


def steps_in(store: ObjectStore, prefix: str) -> dict[int, bool]:
    """step -> committed, for every step directory that holds an object."""
    found: dict[int, bool] = {}
    for key in store.filesystem().find(store.url(prefix)):
        step, _, rest = key.split(f"/{prefix}/", 1)[1].partition("/")
        if step.startswith("step-"):
            found[int(step[5:])] = found.get(int(step[5:]), False) or rest == COMMIT_MARKER
    return found


def plant_torn_copy(store: ObjectStore, prefix: str, of: int, as_step: int) -> None:
    """Every file of committed step `of` under step `as_step`'s name, without COMMITTED: loadable, not committed."""
    fs = store.filesystem()
    src, dst = store.url(prefix, f"step-{of:08d}"), store.url(prefix, f"step-{as_step:08d}")
    for key in fs.find(src):
        rel = key.split(f"step-{of:08d}/", 1)[1]
        if rel != COMMIT_MARKER:
            fs.copy(key, f"{dst}/{rel}")


@pytest.fixture(scope="module")
def runs(object_store_server: ObjectStoreServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    store = object_store_server.new_bucket()
    root = tmp_path_factory.mktemp("ckpt-uri")
    whole = Gang(root / "whole", spec(store, "whole"), env=keys(store))
    killed = Gang(root / "killed", spec(store, "killed"), env={**keys(store), WRITE_DELAY_ENV: "3"})
    staged = f"checkpoint step {TORN_STEP} staged in"
    wait_for(lambda: staged in (killed.out / "rank-0.log").read_text(errors="replace"), 180, interval=0.02,
             what=f"rank 0 to stage step {TORN_STEP}")
    killed.procs[1].kill()
    done: dict[str, Any] = {"whole": whole.wait(), "killed": killed.wait()}
    done["after_kill"] = steps_in(store, "killed")
    plant_torn_copy(store, "killed", of=2, as_step=PLANTED)
    done["gen1"] = Gang(root / "killed", spec(store, "killed"), env=keys(store), generation=1).wait()
    done["after_gen1"] = steps_in(store, "killed")
    done["whole_steps"] = steps_in(store, "whole")
    done["refused"] = Gang(root / "refused", spec(store, "refused"), env=keys(store, "wrong-secret")).wait()
    return done


def test_the_gang_resumes_from_the_newest_committed_step_in_the_bucket(runs: dict[str, Any]) -> None:
    whole, gen0, gen1 = runs["whole"], runs["killed"], runs["gen1"]
    assert whole.exit_codes == [0, 0], whole.log(0)[-3000:] + whole.log(1)[-3000:]
    assert runs["whole_steps"] == {6: True, 8: True}  # keep: 2, pruned in the bucket
    assert whole.progress["lastCheckpoint"]["path"].startswith("s3://")
    assert gen0.exit_codes[1] == 137 and gen0.exit_codes[0] != 0, gen0.log(0)[-3000:]
    assert runs["after_kill"].get(2) is True and not runs["after_kill"].get(TORN_STEP)
    assert gen1.exit_codes == [0, 0], gen1.log(0)[-3000:] + gen1.log(1)[-3000:]
    assert gen1.progress["resumedFrom"] == 2 and "step-00000002 (step 2)" in gen1.log(0)
    assert "never committed (an upload cut off)" in gen1.log(0)
    again = {r["step"]: r["loss"] for r in gen1.records if r["generation"] == 1}
    assert sorted(again) == list(range(3, STEPS + 1))
    assert rel_diff(again, whole.losses) <= 1e-6
    assert runs["after_gen1"] == {6: True, 8: True}  # the planted step was removed, then saved for real


def test_a_wrong_secret_fails_the_gang_at_once_naming_checkpoint_uri(runs: dict[str, Any]) -> None:
    refused: Run = runs["refused"]
    assert refused.exit_codes == [CONFIG_ERROR_EXIT_CODE] * 2, refused.log(0)[-3000:]
    for rank in (0, 1):
        assert "configuration error: checkpoint.uri: s3://" in refused.log(rank)
        assert "credentials were refused" in refused.log(rank)
