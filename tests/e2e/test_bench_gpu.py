"""bench/gpu.py --tiny runs without a GPU and records every measurement (values sane, speed not asserted).

One run of the real script (gloo on CPU, a few M parameters, 12-20 s here): kubetrain's trainer with
FSDP2 and DeepSpeed ZeRO-3 against the hand-written loop, all_reduce bandwidth, and the stall of
a synchronous and an asynchronous DCP checkpoint. Plus the pure parts the tiny run cannot reach:
busbw with more than one rank and the issue's targets for a full-size run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gpu_comm  # bench/, on pytest's pythonpath (pyproject.toml)
import gpu_report
import pytest
from support.paths import REPO_ROOT
from support.trainer_harness import pythonpath

pytestmark = pytest.mark.e2e

SCRIPT = REPO_ROOT / "bench" / "gpu.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("gpu-bench") / "gpu.json"
    env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out)], env=env, cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(out.read_text()), r.stdout


def test_tiny_describes_the_model_and_the_device(tiny: tuple[dict[str, Any], str]) -> None:
    result, _ = tiny
    model = result["model"]
    assert 1_000_000 < model["params_total"] < 20_000_000
    assert model["params_non_embedding"] < model["params_total"]
    n, layers, d, t = model["params_non_embedding"], model["n_layers"], model["d_model"], model["seq_len"]
    assert model["flops_per_token"] == 6 * n + 12 * layers * d * t
    assert result["tiny"] is True
    assert result["device"]["count"] == 1
    assert result["targets"]["mfu_met"] is None  # targets are for the ~1B model on a GPU


def test_tiny_measures_trainer_and_baseline_throughput(tiny: tuple[dict[str, Any], str]) -> None:
    result, _ = tiny
    train = result["train"]
    by_name = {v["name"]: v for v in train["variants"]}
    assert {"baseline", "fsdp2", "deepspeed-zero3"} <= set(by_name)
    assert train["attention"] != "none"
    for v in by_name.values():
        assert "error" not in v, v
        assert v["tokens_per_second"] > 0
        assert len(v["step_seconds"]) == train["steps"]
        assert v["tokens_per_step"] == train["tokens_per_step"]
        assert math.isfinite(v["last_loss"]) and v["last_loss"] > 0
        peak = result["peak_tflops"]
        assert (v["mfu"] is None) if peak is None else (0 < v["mfu"] < 1)


def test_tiny_measures_allreduce_bandwidth(tiny: tuple[dict[str, Any], str]) -> None:
    result, _ = tiny
    ar = result["allreduce"]
    assert ar["world_size"] == 1 and ar["busbw_factor"] is None
    assert "busbw is undefined" in ar["note"]
    assert [row["bytes"] for row in ar["sizes"]] == gpu_comm.TINY_SIZES
    for row in ar["sizes"]:
        assert row["seconds"] > 0 and row["algbw_gbps"] > 0
        assert row["busbw_gbps"] is None  # one rank: nothing crosses a link


def test_tiny_measures_sync_and_async_checkpoint_stall(tiny: tuple[dict[str, Any], str]) -> None:
    result, _ = tiny
    ck = result["checkpoint"]
    assert ck["state_bytes_per_rank"] > 8 * result["model"]["params_total"]  # parameters + two Adam moments
    for mode in ("sync", "async"):
        m = ck[mode]
        assert len(m["stall_seconds"]) == ck["saves"] and all(s > 0 for s in m["stall_seconds"])
        assert len(m["write_seconds"]) == ck["saves"] and all(s > 0 for s in m["write_seconds"])
        assert m["stall_steady_seconds"] > 0
    assert not Path(ck["dir"]).exists()  # the checkpoints were removed


def test_tiny_prints_the_tables(tiny: tuple[dict[str, Any], str]) -> None:
    _, stdout = tiny
    for heading in ("| variant | step s | tokens/s", "| size | time us | algbw GB/s | busbw GB/s |", "| mode | stall s"):
        assert heading in stdout
    assert "| deepspeed-zero3 |" in stdout


def test_busbw_factor_follows_nccl_tests() -> None:
    assert gpu_comm.bus_factor(1) is None
    assert gpu_comm.bus_factor(2) == 1.0
    assert gpu_comm.bus_factor(8) == 1.75


def test_targets_judge_a_full_run() -> None:
    result = {
        "tiny": False,
        "train": {"variants": [
            {"name": "baseline", "loop": "baseline", "mfu": 0.6},
            {"name": "fsdp2", "loop": "trainer", "mfu": 0.41},
            {"name": "fsdp2-compiled", "loop": "trainer", "mfu": 0.47},
            {"name": "deepspeed-zero3", "loop": "trainer", "error": "OutOfMemoryError: ..."},
        ]},
        "checkpoint": {"async": {"stall_steady_seconds": 1.4}},
    }
    t = gpu_report.targets(result)
    assert (t["best_trainer_mfu"], t["mfu_met"]) == (0.47, True)  # the baseline's MFU does not count
    assert (t["async_stall_seconds"], t["async_stall_met"]) == (1.4, False)
    assert gpu_report.targets({"tiny": False})["mfu_met"] is None  # nothing measured: no verdict
