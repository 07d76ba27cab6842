"""torch.profiler traces: spec.profile.steps on every rank, and a running local job asked for one with
`kubetrain profile` (rank 0 reads the request between steps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.trainer_harness import Gang, run_cli, tiny_spec
from support.waiting import wait_for

from kubetrain.core import contract
from kubetrain.trainer.observe.profiling import requested_steps

pytestmark = pytest.mark.e2e


def test_requests_are_a_step_count_and_an_optional_tag() -> None:
    assert [requested_steps(v) for v in ("3", "5:again", " 2 ", "0", "x", None, "1001")] == [3, 5, 2, None, None,
                                                                                          None, None]


def test_spec_profile_traces_every_rank_over_its_steps(tmp_path: Path) -> None:
    run = Gang(tmp_path / "run", tiny_spec(maxSteps=4, profile={"steps": "2-3"})).wait()
    assert run.exit_codes == [0, 0], run.log()
    traces = sorted(p.name for p in (run.ckpt_dir / contract.PROFILES_DIR).iterdir())
    assert traces == ["rank0-steps2-3.pt.trace.json", "rank1-steps2-3.pt.trace.json"]
    events = json.loads((run.ckpt_dir / contract.PROFILES_DIR / traces[0]).read_text())["traceEvents"]
    assert any("aten::mm" in (e.get("name") or "") for e in events)  # the model's matrix products are in it


def test_a_running_local_job_traces_its_next_steps_when_asked(tmp_path: Path) -> None:
    manifest = tmp_path / "long.yaml"
    spec = {**tiny_spec(maxSteps=400), "workers": 2}
    manifest.write_text(yaml.safe_dump({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                        "metadata": {"name": "long"}, "spec": spec}))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "kubetrain.core", "run", str(manifest), "--output-dir", str(out),
                             "-q"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (out / contract.PROGRESS_FILE).exists(), 120, what="the run's first progress record")
        asked = run_cli(["profile", str(out), "--steps", "2"])
        assert asked.returncode == 0, asked.stderr
        profiles = out / "checkpoints" / contract.PROFILES_DIR
        trace = wait_for(lambda: next(iter(profiles.glob("rank0-steps*.pt.trace.json")), None), 120,
                         what="rank 0's trace")
        first, last = (int(s) for s in trace.name.split("steps")[1].split(".")[0].split("-"))
        assert last - first == 1 and not list(profiles.glob("rank1-*"))  # asked of rank 0 only
    finally:
        proc.terminate()
        proc.wait(60)
