"""Pipeline parallelism (spec.parallelism.pipeline) on CPU with gloo, fp32: the same training as one process.

One module fixture runs, concurrently, the plain single-process runs and the pipelined gangs of the same
model (4 blocks) and global batch, then the resumed ones:
- P=2 (world 2, one data replica, schedule GPipe) against one process with the same micro-batches;
- P=2 x data 2 (world 4, FSDP2 over dp on each stage, schedule 1F1B) against one process that accumulates
  both replicas' micro-batches;
- P=2 x T=2 with Interleaved1F1B (world 4: 4 stages of one block, 2 per worker, each split by tensor
  parallelism over the worker's 2 processes) against one process;
- the P=2 x data 2 gang killed after step 7 and resumed from step 5 on the same layout: exact;
- the P=2 and P=2 x data 2 step-10 checkpoints resumed by one process (P=1): the parameter names are the
  whole model's on every stage, so DCP reads each stage's part into the one model.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.trainer_harness import Run, layout_runs, rel_diff, resumed_losses, tiny_spec

pytestmark = pytest.mark.e2e

STEPS = 20
EVERY = 5
TOLERANCE = 1e-5
"""Relative loss difference allowed between layouts: fp32 sums in another order (the data-parallel mean,
the gradient norm's all-reduce over stages) and nothing else differs: each micro-batch's loss and
gradients are computed as one process computes them, and the schedule only orders them."""
GRAD_NORM_TOLERANCE = 1e-3
"""The clipping norm itself, a looser check (it still sees a stage's gradients missing or counted twice): the
norm sums its squares per rank in another order, so the clipped updates differ by ~1e-7, and at some steps
the gradient amplifies those weight differences while the loss and the weights stay within TOLERANCE. Plain
data parallelism shows it too: FSDP2 at world 2 against one process, this model and batch, step 20's norm
differs by 5.5e-5, and P=2 x data 2's by 2.8e-4 (the losses of both within 1.2e-7)."""
NORM_ENV = {"KUBETRAIN_DEBUG_PARAM_NORM": "1"}


def _spec(pipeline: int = 1, tensor: int = 1, workers: int = 1, procs: int = 1, ga: int = 2, schedule: str = "1F1B",
          background: bool = False) -> dict[str, Any]:
    parallelism = {"pipeline": pipeline, "tensor": tensor, "pipelineSchedule": schedule}
    return tiny_spec(strategy="fsdp", maxSteps=STEPS, gradientAccumulationSteps=ga, workers=workers,
                     procsPerWorker=procs, parallelism=parallelism, model={"nLayers": 4},
                     evalEverySteps=EVERY * 2, evalBatches=2,
                     checkpoint={"everySteps": EVERY, "keep": 10, "asyncSave": background})


SPECS: dict[str, tuple[dict[str, Any], int]] = {
    "plain": (_spec(), 1),
    # the micro-batches of both data replicas below, accumulated (and evaluated) by one process
    "plain_ga4": ({**_spec(ga=4), "evalBatches": 4}, 1),
    "pp2": (_spec(pipeline=2, procs=2, schedule="GPipe", background=True), 2),  # background saves, the default
    "pp2_dp2": (_spec(pipeline=2, workers=2, procs=2), 4),  # synchronous saves: the newest before a kill is known
}
"""name -> (spec, world size)."""
PP2_TP2 = (_spec(pipeline=2, tensor=2, workers=2, procs=2, schedule="Interleaved1F1B"), 4)
"""Stages 0 and 2 on worker 0, 1 and 3 on worker 1, each block split by the worker's 2 processes; run beside
the resumed gangs (the cores are busy enough before)."""
RESHARDED = {"pp2": "plain", "pp2_dp2": "plain_ga4"}
"""Pipelined run -> the single-process run whose spec resumes its step-10 checkpoint."""
FAIL_AT = "1:7"
"""The P=2 x data 2 gang's rank 1 (first stage, second replica) dies after step 7; its newest checkpoint is step 5."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    return layout_runs(tmp_path_factory.mktemp("pipeline_parallel"), SPECS, "pp2_dp2", FAIL_AT, RESHARDED,
                       later={"pp2_tp2": PP2_TP2}, env=NORM_ENV)


@pytest.mark.parametrize(("name", "reference"), [("pp2", "plain"), ("pp2_dp2", "plain_ga4"), ("pp2_tp2", "plain")])
def test_pipelined_training_matches_one_process(runs: dict[str, Run], name: str, reference: str) -> None:
    run, ref = runs[name], runs[reference]
    assert run.exit_codes == [0] * len(run.exit_codes), run.log(0)[-3000:]
    assert ref.exit_codes == [0], ref.log(0)[-3000:]
    assert sorted(run.losses) == list(range(1, STEPS + 1))
    assert run.losses[STEPS] < run.losses[1] - 0.5  # it learns
    diff = rel_diff(run.losses, ref.losses)
    print(f"{name} vs {reference}: max relative loss difference over {STEPS} steps {diff:.2e}")
    assert diff <= TOLERANCE
    # the clipping norm adds up every stage's gradients, and the weights are one process's
    assert rel_diff(run.per_step("grad_norm"), ref.per_step("grad_norm")) <= GRAD_NORM_TOLERANCE
    assert rel_diff(run.per_step("param_norm"), ref.per_step("param_norm")) <= TOLERANCE
    # only the last stage computes a loss: the eval mean is its replicas', not diluted by the first stage's
    assert sorted(run.per_step("eval_loss")) == [EVERY * 2, STEPS] and rel_diff(run.per_step("eval_loss"), ref.per_step("eval_loss")) <= TOLERANCE


def test_resume_on_the_same_layout_is_exact(runs: dict[str, Run]) -> None:
    assert resumed_losses(runs, "pp2_dp2", EVERY, STEPS) == 0.0


@pytest.mark.parametrize(("name", "reference"), list(RESHARDED.items()))
def test_a_pipelined_checkpoint_resumes_without_pipelining(runs: dict[str, Run], name: str, reference: str) -> None:
    """Each stage saved its own part under the whole model's names: one process reads them all back."""
    run = runs[f"{name}_to_one"]
    assert run.exit_codes == [0], run.log(0)[-3000:]
    assert run.progress["resumedFrom"] == 10 and run.progress["worldSize"] == 1
    assert sorted(run.losses) == list(range(11, STEPS + 1))
    diff = max(rel_diff(run.losses, runs[name].losses), rel_diff(run.losses, runs[reference].losses))
    print(f"{name} checkpoint resumed at P=1: max relative loss difference {diff:.2e}")
    assert diff <= TOLERANCE
