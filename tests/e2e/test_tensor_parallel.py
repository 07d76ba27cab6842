"""Tensor parallelism (spec.parallelism.tensor) on CPU with gloo, fp32: the same training as one process.

One module fixture runs, concurrently, the plain single-process runs and the tensor-parallel gangs of the
same model and global batch, then the resumed ones:
- T=2 (world 2, one data replica) against one process with the same micro-batches;
- T=2 x data 2 (world 4, FSDP2 over dp) against one process that accumulates both replicas' micro-batches;
- the T=2 x data 2 gang killed after step 7 and resumed from step 5 on the same layout: exact;
- both gangs' step-10 checkpoints resumed by one process (T=1): DCP reshards the DTensors.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.trainer_harness import Run, layout_runs, rel_diff, resumed_losses, tiny_spec

pytestmark = pytest.mark.e2e

STEPS = 20
EVERY = 5
TOLERANCE = 1e-5
"""Relative loss difference allowed between layouts: fp32 sums in another order (the row-parallel all-reduce,
the data-parallel mean) and nothing else differs."""
NORM_ENV = {"KUBETRAIN_DEBUG_PARAM_NORM": "1"}


def _spec(tensor: int = 1, workers: int = 1, procs: int = 1, ga: int = 2, background: bool = False) -> dict[str, Any]:
    return tiny_spec(strategy="fsdp", maxSteps=STEPS, gradientAccumulationSteps=ga, workers=workers,
                     procsPerWorker=procs, parallelism={"tensor": tensor}, evalEverySteps=EVERY * 2, evalBatches=2,
                     checkpoint={"everySteps": EVERY, "keep": 10, "asyncSave": background})


SPECS: dict[str, tuple[dict[str, Any], int]] = {
    "plain": (_spec(), 1),
    # the micro-batches of both data replicas below, accumulated (and evaluated) by one process
    "plain_ga4": ({**_spec(ga=4), "evalBatches": 4}, 1),
    "tp2": (_spec(tensor=2, procs=2, background=True), 2),  # background saves, the default, whose step 10 T=1 resumes
    "tp2_dp2": (_spec(tensor=2, workers=2, procs=2), 4),  # synchronous saves: the newest before a kill is known
}
"""name -> (spec, world size)."""
RESHARDED = {"tp2": "plain", "tp2_dp2": "plain_ga4"}
"""Tensor-parallel run -> the single-process run whose spec resumes its step-10 checkpoint."""
FAIL_AT = "1:7"
"""The T=2 x data 2 gang's rank 1 dies after step 7; its newest checkpoint is step 5."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    return layout_runs(tmp_path_factory.mktemp("tensor_parallel"), SPECS, "tp2_dp2", FAIL_AT, RESHARDED, env=NORM_ENV)


@pytest.mark.parametrize(("name", "reference"), [("tp2", "plain"), ("tp2_dp2", "plain_ga4")])
def test_tensor_parallel_training_matches_one_process(runs: dict[str, Run], name: str, reference: str) -> None:
    run, ref = runs[name], runs[reference]
    assert run.exit_codes == [0] * len(run.exit_codes), run.log(0)[-3000:]
    assert ref.exit_codes == [0], ref.log(0)[-3000:]
    assert sorted(run.losses) == list(range(1, STEPS + 1))
    assert run.losses[STEPS] < run.losses[1] - 0.5  # it learns
    diff = rel_diff(run.losses, ref.losses)
    print(f"{name} vs {reference}: max relative loss difference over {STEPS} steps {diff:.2e}")
    assert diff <= TOLERANCE
    # every parameter element counted once, however it is split: the same weights as one process's
    assert rel_diff(run.per_step("param_norm"), ref.per_step("param_norm")) <= TOLERANCE
    assert sorted(run.per_step("eval_loss")) == [EVERY * 2, STEPS] and rel_diff(run.per_step("eval_loss"), ref.per_step("eval_loss")) <= TOLERANCE


def test_resume_on_the_same_layout_is_exact(runs: dict[str, Run]) -> None:
    assert resumed_losses(runs, "tp2_dp2", EVERY, STEPS) == 0.0


@pytest.mark.parametrize(("name", "reference"), list(RESHARDED.items()))
def test_a_tensor_parallel_checkpoint_resumes_without_tensor_parallelism(
    runs: dict[str, Run], name: str, reference: str
) -> None:
    """DCP reshards the DTensors (tensor-parallel shards, sharded again by FSDP2 over dp) into one process's."""
    run = runs[f"{name}_to_one"]
    assert run.exit_codes == [0], run.log(0)[-3000:]
    assert run.progress["resumedFrom"] == 10 and run.progress["worldSize"] == 1
    assert sorted(run.losses) == list(range(11, STEPS + 1))
    diff = max(rel_diff(run.losses, runs[name].losses), rel_diff(run.losses, runs[reference].losses))
    print(f"{name} checkpoint resumed at T=1: max relative loss difference {diff:.2e}")
    assert diff <= TOLERANCE
