"""`ddp.gradientCompression: powersgd` on CPU with 2 gloo processes, the quickstart's model size in fp32.

One module fixture runs, concurrently: uncompressed DDP, PowerSGD, and PowerSGD killed after step 25
(KUBETRAIN_FAIL_AT); then that run's generation 1 resumes from its step-20 checkpoint, after
compression has started at step 11, so the checkpointed PowerSGD state is what it resumes with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.trainer_harness import Gang, Run, rel_diff, tiny_spec

pytestmark = pytest.mark.e2e

STEPS = 40
START = 10
"""powerSgdStartStep: steps 1-10 use the plain all-reduce."""
QUICKSTART_MODEL = {"dModel": 128, "nLayers": 2, "nHeads": 4, "seqLen": 128}
PLAIN = tiny_spec(
    model=QUICKSTART_MODEL, microBatchSize=4, gradientAccumulationSteps=1, maxSteps=STEPS, seed=1234,
    optimizer={"warmupSteps": START}, checkpoint={"everySteps": 20, "keep": 2},
)
POWERSGD: dict[str, Any] = {
    **PLAIN, "ddp": {"gradientCompression": "powersgd", "powerSgdRank": 2, "powerSgdStartStep": START},
}
FAIL_AT = "1:25"
RESUMED_FROM = 20
FAILING: dict[str, Any] = {**POWERSGD, "checkpoint": {**POWERSGD["checkpoint"], "asyncSave": False}}
"""Saved synchronously: step 20 is committed before step 21 whatever the load (a background write commits
at a later step's all-reduce)."""
LAST = 5
"""The final loss is the mean of the last 5 steps: one step's loss is one batch of 8 windows, noisy."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("powersgd")
    gangs = {
        "plain": Gang(root / "plain", PLAIN),
        "powersgd": Gang(root / "powersgd", POWERSGD),
        "failed": Gang(root / "resumed", FAILING, env={"KUBETRAIN_FAIL_AT": FAIL_AT}),
    }
    done = {name: gang.wait() for name, gang in gangs.items()}
    done["resumed"] = Gang(root / "resumed", FAILING, generation=1).wait()
    for name in ("plain", "powersgd", "resumed"):
        assert done[name].exit_codes == [0, 0], done[name].log(0)[-3000:] + done[name].log(1)[-3000:]
    return done


def _bytes(run: Run) -> dict[int, int]:
    return {r["step"]: r["allreduce_bytes"] for r in run.records}


def test_powersgd_loss_follows_uncompressed_training(runs: dict[str, Run]) -> None:
    plain, compressed = runs["plain"].losses, runs["powersgd"].losses
    assert sorted(compressed) == list(range(1, STEPS + 1))
    final_plain, final = (sum(run[s] for s in range(STEPS - LAST + 1, STEPS + 1)) / LAST for run in (plain, compressed))
    gap = (final - final_plain) / final_plain
    print(f"final loss (mean of steps {STEPS - LAST + 1}-{STEPS}): uncompressed {final_plain:.4f}, "
          f"powersgd {final:.4f} ({gap:+.1%}); step {STEPS}: {plain[STEPS]:.4f} vs {compressed[STEPS]:.4f}")
    assert final < compressed[1] - 2.0, compressed  # it learns: ~5.57 -> ~2.8
    assert abs(gap) <= 0.05
    # Before compression starts, the hook is a plain all-reduce: the same trajectory.
    assert rel_diff({s: compressed[s] for s in range(1, START + 1)}, plain) <= 1e-5


def test_powersgd_all_reduces_at_least_4x_fewer_bytes(runs: dict[str, Run]) -> None:
    plain, compressed = _bytes(runs["plain"]), _bytes(runs["powersgd"])
    per_step = set(plain.values())
    assert len(per_step) == 1 and per_step.pop() > 0
    # Warm-up steps: the hook's own count of the plain all-reduce equals DDP's gradient bytes.
    assert all(compressed[s] == plain[s] for s in range(1, START + 1))
    after = [compressed[s] for s in range(START + 1, STEPS + 1)]
    factor = plain[STEPS] / max(after)
    print(f"all-reduce bytes per step: uncompressed {plain[STEPS]}, powersgd {max(after)} ({factor:.1f}x fewer)")
    assert factor >= 4, factor


def test_powersgd_resume_is_exact(runs: dict[str, Run]) -> None:
    failed, resumed = runs["failed"], runs["resumed"]
    assert 137 in failed.exit_codes
    assert resumed.progress["resumedFrom"] == RESUMED_FROM
    gen1 = {r["step"]: r["loss"] for r in resumed.records if r["generation"] == 1}
    assert sorted(gen1) == list(range(RESUMED_FROM + 1, STEPS + 1))
    diff = rel_diff(gen1, runs["powersgd"].losses)
    print(f"resumed vs uninterrupted PowerSGD: max relative loss difference {diff:.2e}")
    assert diff <= 1e-5
    states = sorted(p.name for p in (resumed.ckpt_dir / "step-00000040" / "powersgd").iterdir())
    assert states == ["rank-00000.pt", "rank-00001.pt"]


def test_powersgd_refuses_fp16(tmp_path: Path) -> None:
    run = Gang(tmp_path, {**POWERSGD, "precision": "fp16", "maxSteps": 2}).wait()
    # Each rank checks; the first to exit 2 ends the gang, so the other may be stopped (143) after its own check.
    refused = [r for r, code in enumerate(run.exit_codes) if code == 2]
    assert refused, (run.exit_codes, run.log(0)[-3000:])
    assert "ddp.gradientCompression powersgd cannot run with precision fp16" in run.log(refused[0])
