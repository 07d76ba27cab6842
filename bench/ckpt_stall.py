"""Checkpoint stall of the trainer: synchronous against background (checkpoint.asyncSave) durable saves.

    .venv/bin/python bench/ckpt_stall.py [--repeats 5] [--steps 120] [--every 20] [--modes none,sync,async]
        [--out bench/results/X.json]

The quickstart job (examples/quickstart.yaml: FSDP2, bf16, GA 2, activation checkpointing, d_model 128,
a save every 20 steps) runs as 2 gloo processes on CPU (tests/support/trainer_harness.py, OMP_NUM_THREADS=1)
for ``--steps`` steps, in each of ``--modes`` (default: the first three), one after the other per repeat: saves every ``--every`` steps
written synchronously (``sync``), the same written in the background (``async``), and no save but the last
one (``none``: the step time without saves); ``s3`` is ``async`` with checkpoint.uri on a bucket of a private
S3Proxy server (tests/support/objectstore.py's ObjectStoreServer on loopback, its jar fetched by
`hack/build.sh s3proxy`): the background writer uploads through s3fs instead of writing local files.

- **Stall per save**: how long rank 0's loop was stopped by a save, as the trainer measures and logs it
  ("checkpoint step N staged in X s" / "committed in X s": the wait for the previous write, the directory
  barrier, then staging or the whole write), for every save but the last (which waits for its write in
  both modes, by design). The first save of a process also pays one-time costs (DCP's first plan, the
  staging buffers' allocation): "steady" leaves it out.
- **Step time**: the mean interval between consecutive losses.jsonl time stamps (rank 0) from the step
  after the first save on (the steady range, the same steps in every mode): the intervals after a save
  step hold its stall, and every interval whatever a background write takes from training. Its ratio to
  the ``none`` run of the same repeat is what saves cost (paired: the runs are seconds apart).
- **CPU per step**: rank 0's process CPU seconds per step over the same range (losses.jsonl ``cpu_time``:
  the training thread, the save and the background writer thread): the cost of saves that the other
  tenants of a shared machine cannot blur. (its ratio to ``none`` − 1) × every step time is CPU per save.
- **Write per save** (``async``, ``s3``): how long the background write (and upload) of each save took,
  as rank 0 logs it ("checkpoint step N committed: write took X s"), the last save left out.
The 1-minute load average before and after each run is recorded: on a shared machine it tells how much of
a wall-clock difference is the other tenants'.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml
from support.objectstore import REGION, ObjectStore, ObjectStoreServer, s3proxy_jar
from support.paths import EXAMPLE_DATA, QUICKSTART  # bench/support: a link to tests/support
from support.trainer_harness import Gang, Run

MODES = ("none", "sync", "async", "s3")
DEFAULT_MODES = "none,sync,async"  # s3 needs S3Proxy fetched and Java
STALL_LINE = re.compile(r"checkpoint step (\d+) (?:staged|committed) in ([0-9.]+) ?s")
WRITE_LINE = re.compile(r"checkpoint step (\d+) committed: write took ([0-9.]+) ?s")


def quickstart_spec(steps: int, every: int, mode: str, store: ObjectStore | None = None) -> dict[str, Any]:
    spec = yaml.safe_load(QUICKSTART.read_text())["spec"]
    spec["data"] = {**spec["data"], "path": str(EXAMPLE_DATA)}
    spec["maxSteps"] = steps
    spec["checkpoint"] = {**spec["checkpoint"], "everySteps": every if mode != "none" else 10**6,
                          "asyncSave": mode in ("async", "s3")}
    if store is not None:
        spec["checkpoint"] |= {"uri": store.url("ckpt")}
        spec["s3"] = {"endpoint": store.endpoint_url, "region": REGION}
    return spec


def store_env(store: ObjectStore | None) -> dict[str, str]:
    """The keys only: endpoint and region come from spec.s3, as in a cluster."""
    if store is None:
        return {}
    return {"AWS_ACCESS_KEY_ID": store.access_key, "AWS_SECRET_ACCESS_KEY": store.secret_key}


def stalls(run: Run, last: int) -> dict[int, float]:
    """step -> seconds rank 0 was stopped by that save, from its log (the last save left out)."""
    return {int(s): float(x) for s, x in STALL_LINE.findall(run.log(0)) if int(s) != last}


def writes(run: Run, last: int) -> dict[int, float]:
    """step -> seconds the background write (and upload) of that save took, from rank 0's log."""
    return {int(s): float(x) for s, x in WRITE_LINE.findall(run.log(0)) if int(s) != last}


def per_step(run: Run, key: str, first: int, last: int) -> float:
    """Mean per step of a losses.jsonl counter (``time``, ``cpu_time``) from step ``first`` to ``last``."""
    at = {r["step"]: r[key] for r in run.records}
    return (at[last] - at[first]) / (last - first)


def measure(out: Path, steps: int, every: int, mode: str, store: ObjectStore | None = None) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    run = Gang(out, quickstart_spec(steps, every, mode, store), 2, env=store_env(store), timeout=900).wait()
    assert run.exit_codes == [0, 0], run.log(0)[-3000:]
    first = every + 1  # the steady range starts after the first save, the same steps in every mode
    return {
        "mode": mode,
        "stall_seconds": stalls(run, steps),
        "write_seconds": writes(run, steps),
        "step_seconds": per_step(run, "time", first, steps),
        "cpu_seconds_per_step": per_step(run, "cpu_time", first, steps),
        "seconds": run.seconds,
        "load_average": [load_before, os.getloadavg()[0]],
    }


def stall_summary(every_stall: list[float], steady: list[float]) -> dict[str, Any]:
    if not every_stall:
        return {"saves": 0}
    return {
        "saves": len(every_stall),
        "stall_mean_seconds": statistics.mean(every_stall),
        "stall_max_seconds": max(every_stall),
        "stall_steady_mean_seconds": statistics.mean(steady),
        "stall_steady_max_seconds": max(steady),
    }


def write_summary(runs: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """Background write times: every save, and "steady" (the first save, which also connects, left out)."""
    every_write = [w for r in runs for w in r["write_seconds"].values()]
    steady = [w for r in runs for step, w in r["write_seconds"].items() if int(step) > every]
    if not every_write:
        return {}
    return {"write_mean_seconds": statistics.mean(every_write), "write_max_seconds": max(every_write),
            "write_steady_mean_seconds": statistics.mean(steady), "write_steady_max_seconds": max(steady)}


def summary(runs: list[dict[str, Any]], every: int, modes: list[str]) -> dict[str, Any]:
    """Per mode: stalls over every save of every repeat; step time and CPU per step, paired with none."""
    out: dict[str, Any] = {}
    reference = {r["repeat"]: r for r in runs if r["mode"] == "none"}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        every_stall = [s for r in mine for s in r["stall_seconds"].values()]
        steady = [s for r in mine for step, s in r["stall_seconds"].items() if int(step) > every]
        wall = [r["step_seconds"] / reference[r["repeat"]]["step_seconds"] for r in mine]
        cpu = [r["cpu_seconds_per_step"] / reference[r["repeat"]]["cpu_seconds_per_step"] for r in mine]
        cpu_per_save = [(r["cpu_seconds_per_step"] - reference[r["repeat"]]["cpu_seconds_per_step"]) * every
                        for r in mine]
        out[mode] = {
            **stall_summary(every_stall, steady),
            **write_summary(mine, every),
            "step_seconds_mean": statistics.mean(r["step_seconds"] for r in mine),
            "step_time_vs_none_median": statistics.median(wall),
            "step_time_vs_none": wall,
            "cpu_seconds_per_step_mean": statistics.mean(r["cpu_seconds_per_step"] for r in mine),
            "cpu_per_step_vs_none_median": statistics.median(cpu),
            "cpu_per_step_vs_none": cpu,
            "cpu_seconds_per_save_median": statistics.median(cpu_per_save),
        }
    return out


def modes_arg(value: str) -> list[str]:
    modes = value.split(",")
    if "none" not in modes or not set(modes) <= set(MODES):
        raise argparse.ArgumentTypeError(f"a comma-separated subset of {','.join(MODES)} with none in it")
    return modes


def run_repeats(args: argparse.Namespace, server: ObjectStoreServer | None) -> list[dict[str, Any]]:
    runs = []
    for i in range(args.repeats):
        for mode in args.modes:
            store = server.new_bucket() if mode == "s3" and server is not None else None
            with tempfile.TemporaryDirectory(prefix="kt-stall-") as tmp:
                result = {"repeat": i, **measure(Path(tmp), args.steps, args.every, mode, store)}
            runs.append(result)
            stall, write = list(result["stall_seconds"].values()), list(result["write_seconds"].values())
            print(f"repeat {i + 1} {mode}: step {result['step_seconds']:.4f} s, "
                  f"CPU {result['cpu_seconds_per_step']:.4f} s/step, stalls {[round(s, 3) for s in stall]}, "
                  f"writes {[round(s, 2) for s in write]}, "
                  f"load {[round(x, 1) for x in result['load_average']]}", flush=True)
    return runs


def with_server(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The repeats, with an S3Proxy server on loopback for the s3 mode's buckets while they run."""
    if "s3" not in args.modes:
        return run_repeats(args, None)
    with tempfile.TemporaryDirectory(prefix="kt-stall-s3-") as tmp:
        server = ObjectStoreServer(s3proxy_jar(), Path(tmp)).start()
        try:
            return run_repeats(args, server)
        finally:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--modes", type=modes_arg, default=DEFAULT_MODES, help=f"of {','.join(MODES)}; with none")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = with_server(args)
    report = {"steps": args.steps, "every": args.every, "nproc": 2, "spec": QUICKSTART.name,
              "modes": args.modes, "summary": summary(runs, args.every, args.modes), "runs": runs}
    print(json.dumps(report["summary"], indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
