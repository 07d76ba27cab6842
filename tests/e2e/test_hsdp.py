"""HSDP (spec.parallelism.replicate) on CPU with gloo, fp32: FSDP2 within groups, replicated across them.

One module fixture runs, concurrently, 2 workers x 2 processes as DDP and as HSDP (replicate 2 x shard 2) on the
same model and global batch, one process accumulating the same micro-batches, and the HSDP gang once more with
a rank killed after step 7; then that gang's next generation, and the HSDP gang's step-10 checkpoint resumed by
one process as plain FSDP. Two micro-batches a step, so the HSDP gang reduce-scatters every micro-batch and
all-reduces across the groups once a step.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.trainer_harness import Run, layout_runs, rel_diff, resumed_losses, tiny_spec

pytestmark = pytest.mark.e2e

STEPS = 20
EVERY = 5
TOLERANCE = 1e-4
"""Relative loss difference allowed against DDP: the same training, with fp32 sums in another order."""
NORM_ENV = {"KUBETRAIN_DEBUG_PARAM_NORM": "1"}


def _spec(strategy: str = "fsdp", workers: int = 1, procs: int = 1, ga: int = 2, replicate: int = 1) -> dict[str, Any]:
    return tiny_spec(strategy=strategy, maxSteps=STEPS, gradientAccumulationSteps=ga, workers=workers,
                     procsPerWorker=procs, parallelism={"replicate": replicate},
                     checkpoint={"everySteps": EVERY, "keep": 10, "asyncSave": False})


SPECS: dict[str, tuple[dict[str, Any], int]] = {
    "ddp": (_spec("ddp", workers=2, procs=2), 4),
    "hsdp": (_spec(workers=2, procs=2, replicate=2), 4),
    "plain_ga8": (_spec(ga=8), 1),  # the 4 data ranks' micro-batches, accumulated by one process
}
"""name -> (spec, world size)."""
FAIL_AT = "1:7"
"""The HSDP gang's rank 1 dies after step 7; its newest checkpoint is step 5."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    return layout_runs(tmp_path_factory.mktemp("hsdp"), SPECS, "hsdp", FAIL_AT, {"hsdp": "plain_ga8"}, env=NORM_ENV)


def test_hsdp_trains_as_ddp_does(runs: dict[str, Run]) -> None:
    hsdp, ddp = runs["hsdp"], runs["ddp"]
    assert hsdp.exit_codes == [0] * 4, hsdp.log(0)[-3000:]
    assert ddp.exit_codes == [0] * 4, ddp.log(0)[-3000:]
    assert "device mesh: replicate 2 x dp 2" in hsdp.log(0)  # sharded within groups of 2, replicated across 2
    assert sorted(hsdp.losses) == list(range(1, STEPS + 1))
    assert hsdp.losses[STEPS] < hsdp.losses[1] - 0.5  # it learns
    diff = rel_diff(hsdp.losses, ddp.losses)
    print(f"hsdp (replicate 2 x shard 2) vs ddp: max relative loss difference over {STEPS} steps {diff:.2e}")
    assert diff <= TOLERANCE
    # every element counted once over shards and replicas: the same weights as DDP's
    assert rel_diff(hsdp.per_step("param_norm"), ddp.per_step("param_norm")) <= TOLERANCE
    assert rel_diff(hsdp.losses, runs["plain_ga8"].losses) <= TOLERANCE


def test_a_killed_hsdp_gang_resumes_exactly(runs: dict[str, Run]) -> None:
    assert resumed_losses(runs, "hsdp", EVERY, STEPS) == 0.0


def test_an_hsdp_checkpoint_resumes_as_plain_fsdp(runs: dict[str, Run]) -> None:
    """DCP reshards the (replicate, shard) DTensors into one process's FSDP2 parameters and moments."""
    run = runs["hsdp_to_one"]
    assert run.exit_codes == [0], run.log(0)[-3000:]
    assert run.progress["resumedFrom"] == 10 and run.progress["worldSize"] == 1
    assert sorted(run.losses) == list(range(11, STEPS + 1))
    diff = rel_diff(run.losses, runs["hsdp"].losses)
    print(f"hsdp checkpoint resumed as plain FSDP (1 process): max relative loss difference {diff:.2e}")
    assert diff <= TOLERANCE
