"""Tensor parallelism for Hugging Face models (model.hfPath) on CPU with gloo, fp32: the same training as one
process.

Tiny random Llama and Qwen3 models with grouped-query attention (4 query heads, 2 key/value heads, byte
vocabulary) are each trained by T=2 (one worker, 2 processes: each holds 2 query heads and 1 key/value
head) and by one process on the same data and global batch; the Llama gang's step-10 checkpoint is then
resumed by one process (DCP reshards the DTensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.hf_models import tiny_causal_lm
from support.trainer_harness import Run, layout_runs, rel_diff, tiny_spec

pytestmark = pytest.mark.e2e
pytest.importorskip("transformers")

STEPS = 20
TOLERANCE = 1e-5
"""Relative difference allowed between layouts: fp32 sums in another order (the row-parallel all-reduces) and
nothing else differs. Qwen3's per-head norms left as plain tensors (each process's gradient a partial sum of
its own heads) drift past it: 2.3e-5 in the loss and 1.6e-4 in the weights' norm over these 20 steps."""
FAMILIES = ("llama", "qwen3")


def _spec(model_dir: Path, tensor: int) -> dict[str, Any]:
    return tiny_spec(strategy="fsdp", maxSteps=STEPS, procsPerWorker=tensor, parallelism={"tensor": tensor},
                     model={"hfPath": str(model_dir), "seqLen": 32}, checkpoint={"everySteps": 10, "keep": 2})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("tensor_parallel_hf")
    dirs = {family: tiny_causal_lm(root / f"{family}_model", family) for family in FAMILIES}
    specs = {"llama": (_spec(dirs["llama"], 1), 1), "llama_tp2": (_spec(dirs["llama"], 2), 2)}
    later = {"qwen3": (_spec(dirs["qwen3"], 1), 1), "qwen3_tp2": (_spec(dirs["qwen3"], 2), 2)}
    return layout_runs(root, specs, None, "", {"llama_tp2": "llama"}, later=later,
                       env={"KUBETRAIN_DEBUG_PARAM_NORM": "1"})


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tensor_parallel_hf_model_trains_as_one_process(runs: dict[str, Run], family: str) -> None:
    run, ref = runs[f"{family}_tp2"], runs[family]
    assert run.exit_codes == [0, 0], run.log(0)[-3000:]
    assert ref.exit_codes == [0], ref.log(0)[-3000:]
    assert sorted(run.losses) == list(range(1, STEPS + 1)) and run.losses[STEPS] < run.losses[1] - 0.5  # it learns
    diff = rel_diff(run.losses, ref.losses)
    norms = rel_diff(run.per_step("param_norm"), ref.per_step("param_norm"))
    print(f"{family} T=2 vs one process over {STEPS} steps: max relative difference loss {diff:.2e}, "
          f"weights' norm {norms:.2e}")
    assert diff <= TOLERANCE and norms <= TOLERANCE  # the same weights, every element counted once


def test_a_tensor_parallel_llama_checkpoint_resumes_on_one_process(runs: dict[str, Run]) -> None:
    one = runs["llama_tp2_to_one"]
    assert one.exit_codes == [0], one.log(0)[-3000:]
    assert one.progress["resumedFrom"] == 10 and one.progress["worldSize"] == 1
    assert sorted(one.losses) == list(range(11, STEPS + 1))
    diff = max(rel_diff(one.losses, runs["llama_tp2"].losses), rel_diff(one.losses, runs["llama"].losses))
    print(f"llama T=2 step-10 checkpoint resumed by one process: max relative loss difference {diff:.2e}")
    assert diff <= TOLERANCE
