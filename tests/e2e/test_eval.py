"""Evaluation (spec.evalEverySteps) on CPU with 2 gloo processes per gang: the held-out loss is the same
under DDP, FSDP2 and DeepSpeed ZeRO-3 (fp32), it reaches the progress record, the metrics and
`kubetrain run`'s summary, and the checkpoint taken at the lowest eval loss is recorded and kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.trainer_harness import Gang, Run, rel_diff, run_cli, tiny_spec

from kubetrain.core.progress import complete_checkpoints

pytestmark = pytest.mark.e2e

EVAL = {"maxSteps": 10, "evalEverySteps": 5, "evalBatches": 2, "checkpoint": {"everySteps": 5, "keep": 1}}
SPECS: dict[str, dict[str, Any]] = {
    "ddp": tiny_spec(strategy="ddp", **EVAL),
    "fsdp": tiny_spec(strategy="fsdp", **EVAL),
    "ds3": tiny_spec(strategy="deepspeed", deepspeed={"zeroStage": 3}, **EVAL),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("eval")
    gangs = {name: Gang(root / name, spec) for name, spec in SPECS.items()}
    return {name: g.wait() for name, g in gangs.items()}


def evals(run: Run) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in run.records if "eval_loss" in r}


@pytest.mark.parametrize("name", list(SPECS))
def test_eval_runs_every_n_steps_and_reaches_progress(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.exit_codes == [0, 0], run.log()
    assert sorted(evals(run)) == [5, 10]
    assert run.progress["evalLoss"] == evals(run)[10]
    assert "eval loss" in run.log(0)


@pytest.mark.parametrize("name", ["fsdp", "ds3"])
def test_eval_loss_is_the_same_under_every_strategy(runs: dict[str, Run], name: str) -> None:
    assert sorted(evals(runs[name])) == sorted(evals(runs["ddp"]))
    assert rel_diff(evals(runs[name]), evals(runs["ddp"])) <= 1e-4, (evals(runs[name]), evals(runs["ddp"]))


def test_the_best_eval_checkpoint_is_recorded_and_kept(runs: dict[str, Run]) -> None:
    run = runs["ddp"]
    best = json.loads((run.ckpt_dir / "best-eval.json").read_text())
    e = evals(run)
    assert best["loss"] == min(e.values()) and best["step"] == min(e, key=lambda s: e[s])
    kept = [step for step, _ in complete_checkpoints(run.ckpt_dir)]
    assert best["step"] in kept and kept[-1] == 10 and run.progress["bestEvalStep"] == best["step"]


def test_a_local_run_shows_eval_loss_in_its_summary(tmp_path: Path) -> None:
    spec = tiny_spec(**EVAL)
    manifest = tmp_path / "eval.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                        "metadata": {"name": "evaljob"}, "spec": {**spec, "workers": 2}}))
    r = run_cli(["run", str(manifest), "--output-dir", str(tmp_path / "out"), "--summary-json",
                 str(tmp_path / "s.json")], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["eval_loss"] is not None and summary["eval_loss"] > 0 and summary["best_eval_step"] in (5, 10)
