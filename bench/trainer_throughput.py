"""Trainer throughput vs a minimal hand-written loop (same model, strategy, precision, processes).

    .venv/bin/python bench/trainer_throughput.py [--repeats 3] [--steps 20] [--strategies ddp,fsdp]

Both run as N gloo processes on CPU with OMP_NUM_THREADS=1 (tests/e2e/trainer_harness.py).
Tokens/s come from the median wall-clock time between consecutive step ends after the
first 3 steps (medians resist the noise of a shared machine), checkpoints off (the
trainer's only checkpoint is the final one, after the last measured step). The
trainer is timed from the time stamps of its losses.jsonl lines, so its logging,
progress file, metrics and per-step loss all-reduce are inside each interval. Runs
alternate trainer / baseline and the medians over runs are compared; target ratio >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from trainer_harness import Gang, read_records, tiny_spec  # noqa: E402

WARMUP = 3


def bench_spec(strategy: str, precision: str, steps: int) -> dict[str, Any]:
    return tiny_spec(
        strategy=strategy,
        precision=precision,
        microBatchSize=8,
        gradientAccumulationSteps=2,
        maxSteps=steps,
        model={"dModel": 128, "nLayers": 4, "nHeads": 4, "seqLen": 128},
        checkpoint={"everySteps": 10**6, "keep": 1},
    )


def trainer_tps(out: Path, spec: dict[str, Any], nproc: int) -> float:
    run = Gang(out, spec, nproc, timeout=600).wait()
    assert all(c == 0 for c in run.exit_codes), run.log(0)[-2000:]
    recs = read_records(out)
    times = [r["time"] for r in recs if r["step"] >= WARMUP]
    median = statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
    tokens = spec["microBatchSize"] * spec["gradientAccumulationSteps"] * nproc * spec["model"]["seqLen"]
    return tokens / median


def baseline_tps(out: Path, spec: dict[str, Any], nproc: int) -> float:
    cmd = [sys.executable, str(REPO / "bench" / "trainer_baseline_loop.py")]
    run = Gang(out, spec, nproc, timeout=600, command=cmd, env={"BENCH_WARMUP_STEPS": str(WARMUP)}).wait()
    assert all(c == 0 for c in run.exit_codes), run.log(0)[-2000:]
    line = [ln for ln in run.log(0).splitlines() if ln.startswith("{")][-1]
    return float(json.loads(line)["tokens_per_second"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--configs", default="ddp:fp32,fsdp:bf16", help="strategy:precision pairs")
    args = ap.parse_args()
    results = []
    for pair in args.configs.split(","):
        strategy, precision = pair.split(":")
        spec = bench_spec(strategy, precision, args.steps)
        tr, bl = [], []
        for i in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="kt-bench-") as tmp:
                tr.append(trainer_tps(Path(tmp) / "trainer", spec, args.nproc))
                bl.append(baseline_tps(Path(tmp) / "baseline", spec, args.nproc))
                shutil.rmtree(tmp, ignore_errors=True)
            print(
                f"{strategy}/{precision} run {i + 1}: trainer {tr[-1]:.0f} tok/s, baseline {bl[-1]:.0f} tok/s",
                flush=True,
            )
        t, b = statistics.median(tr), statistics.median(bl)
        results.append({"strategy": strategy, "precision": precision, "nproc": args.nproc, "trainer": t, "baseline": b})
        print(f"{strategy}/{precision}: trainer {t:.0f} tok/s, baseline {b:.0f} tok/s, ratio {t / b:.3f}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
