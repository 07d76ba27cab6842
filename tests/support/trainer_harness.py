"""Launch N processes of ``python -m kubetrain.trainer`` with the worker env contract (gloo on CPU),
or the ``kubetrain`` CLI (run_cli).

Used by tests/e2e/, tests/integration/test_progress_reporting.py and bench/. Every rank gets
OMP_NUM_THREADS=1, a free MASTER_PORT, a short process-group timeout and its own log file; when
one rank fails the others are terminated (as a backend would restart the gang). Within
:func:`forked_ranks` (the e2e tier) the ranks are forked from a fork server that imported torch once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubetrain.core import contract

from .forkserver import ForkedRank, Server
from .paths import EXAMPLE_DATA, REPO_ROOT
from .ports import free_port
from .processes import stop_process

SRC_PATHS = (REPO_ROOT / "trainer-image" / "src", REPO_ROOT / "core" / "src")
"""The trainer's sources: a child's PYTHONPATH starts with them, so it runs this checkout's code."""


RANK_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
"""Every rank's: one compute thread each (the gang shares the machine's cores), output as it is written."""


def pythonpath(*rest: str) -> str:
    """A PYTHONPATH of SRC_PATHS, then ``rest``."""
    return os.pathsep.join([*map(str, SRC_PATHS), *rest])


def tiny_spec(**overrides: Any) -> dict[str, Any]:
    """A wire-form TrainingJobSpec small enough for a 2-core CI machine."""
    spec: dict[str, Any] = {
        "strategy": "ddp",
        "precision": "fp32",
        "microBatchSize": 2,
        "gradientAccumulationSteps": 2,
        "maxSteps": 10,
        "seed": 7,
        "model": {"dModel": 32, "nLayers": 2, "nHeads": 2, "seqLen": 32},
        "data": {"path": str(EXAMPLE_DATA)},
        "optimizer": {"lr": 3e-3, "minLr": 3e-4, "warmupSteps": 2, "gradClip": 1.0},
        "checkpoint": {"everySteps": 100, "keep": 3},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def memory_tier_env(directory: Path, every_steps: int, budget_bytes: int | None = None) -> dict[str, str]:
    """The contract's checkpoint.memory variables (a Gang's ranks keep no memory tier without them)."""
    env = {"KUBETRAIN_MEMORY_CKPT_DIR": str(directory), "KUBETRAIN_MEMORY_CKPT_EVERY_STEPS": str(every_steps)}
    if budget_bytes is not None:
        env["KUBETRAIN_MEMORY_CKPT_BYTES"] = str(budget_bytes)
    return env


def tiny_job(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A TrainingJob manifest around a wire-form spec (tiny_spec's), for `kubetrain run`."""
    return {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name}, "spec": spec}


@dataclass
class Run:
    out: Path
    exit_codes: list[int]
    seconds: float
    records: list[dict[str, Any]] = field(default_factory=list)
    """losses.jsonl lines, all generations, in order."""
    progress: dict[str, Any] = field(default_factory=dict)
    """progress.json as it was when the gang ended."""

    @property
    def losses(self) -> dict[int, float]:
        """step -> loss; a step recomputed after a resume keeps its latest value."""
        return {r["step"]: r["loss"] for r in self.records}

    def per_step(self, key: str) -> dict[int, float]:
        """step -> the records' `key` (param_norm, grad_norm, eval_loss, ...), where a record has it."""
        return {r["step"]: r[key] for r in self.records if key in r}

    def log(self, rank: int = 0) -> str:
        return (self.out / f"rank-{rank}.log").read_text(errors="replace")

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"


class Gang:
    """A started gang of trainer processes (call :meth:`wait`)."""

    def __init__(
        self,
        out: Path,
        spec: dict[str, Any],
        world_size: int = 2,
        *,
        generation: int = 0,
        env: dict[str, str] | None = None,
        timeout: float = 240.0,
        command: list[str] | None = None,
    ) -> None:
        self.out = out
        self.timeout = timeout
        out.mkdir(parents=True, exist_ok=True)
        config = out / f"config-{generation}.json"
        config.write_text(json.dumps(spec))
        port = free_port()
        self.procs: list[subprocess.Popen[bytes] | ForkedRank] = []
        self.start = time.monotonic()
        for rank in range(world_size):
            penv = {
                **os.environ,
                "PYTHONPATH": pythonpath(os.environ.get("PYTHONPATH", "")),
                **RANK_THREADS,
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "KUBETRAIN_JOB": "test",
                "KUBETRAIN_CONFIG": str(config),
                "KUBETRAIN_CHECKPOINT_DIR": str(out / "checkpoints"),
                "KUBETRAIN_OUTPUT_DIR": str(out),
                "KUBETRAIN_RESTART_GENERATION": str(generation),
                "KUBETRAIN_METRICS_PORT": "0",
                "KUBETRAIN_DIST_TIMEOUT_SECONDS": "60",
                "KUBETRAIN_DEVICE": "cpu",
                **(env or {}),
            }
            penv.pop("PET_NPROC_PER_NODE", None)
            if penv["KUBETRAIN_METRICS_PORT"] != "0":  # one port per rank, as the launcher and the backends give
                penv["KUBETRAIN_METRICS_PORT"] = str(int(penv["KUBETRAIN_METRICS_PORT"]) + rank)
            self.procs.append(_start_rank(command, penv, out, out / f"rank-{rank}.log"))

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def wait(self) -> Run:
        deadline = self.start + self.timeout
        codes: list[int | None] = [None] * len(self.procs)
        while any(c is None for c in codes):
            for i, p in enumerate(self.procs):
                if codes[i] is None and p.poll() is not None:
                    codes[i] = p.returncode
                    if p.returncode != 0 and p.returncode != 143:
                        self._stop_others()  # gang semantics: one failure ends the generation
            if time.monotonic() > deadline:
                self._stop_others(kill=True)
            time.sleep(0.05)
        exit_codes = [128 - c if c < 0 else c for c in codes if c is not None]
        progress_file = self.out / "progress.json"
        progress = json.loads(progress_file.read_text()) if progress_file.exists() else {}
        return Run(self.out, exit_codes, time.monotonic() - self.start, read_records(self.out), progress)

    def _stop_others(self, kill: bool = False) -> None:
        for p in self.procs:
            if kill:
                p.kill()
            else:
                stop_process(p, grace=20)


def _start_rank(command: list[str] | None, env: dict[str, str], cwd: Path,
                log: Path) -> subprocess.Popen[bytes] | ForkedRank:
    """The built-in trainer forked from the session's fork server where there is one (forked_ranks) and the
    rank's environment allows; otherwise, and for a custom command, a new process."""
    if command is None and (server := _server()) is not None and server.compatible(env):
        return server.spawn(env, cwd, log)
    with log.open("ab") as out:
        return subprocess.Popen(command or [sys.executable, "-m", "kubetrain.trainer"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=cwd)


_FORKS: dict[str, Any] = {"work": None, "server": None}
"""forked_ranks' state: the directory it was given, and the server once the first rank has started it."""


@contextmanager
def forked_ranks(work: Path) -> Iterator[None]:
    """Within: gangs fork their ranks from one fork server (support.forkserver: torch and the trainer imported
    once, started by the first rank) rather than start each interpreter afresh. KUBETRAIN_TEST_FORKSERVER=0:
    not."""
    if os.environ.get("KUBETRAIN_TEST_FORKSERVER", "1") == "0":
        yield
        return
    _FORKS["work"] = work
    try:
        yield
    finally:
        server, _FORKS["server"], _FORKS["work"] = _FORKS["server"], None, None
        if server is not None:
            server.stop()


def _server() -> Server | None:
    if _FORKS["server"] is None and _FORKS["work"] is not None:
        env = {**os.environ, "PYTHONPATH": pythonpath(os.environ.get("PYTHONPATH", "")), **RANK_THREADS}
        _FORKS["server"] = Server(_FORKS["work"], env).start()
    server: Server | None = _FORKS["server"]
    return server


def read_records(out: Path) -> list[dict[str, Any]]:
    path = out / "losses.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 120,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`kubetrain ARGS...` (python -m kubetrain.core), its output captured as text; `cwd`: where it runs (a
    custom command's relative paths resolve there)."""
    return subprocess.run(
        [sys.executable, "-m", "kubetrain.core", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})}, cwd=cwd,
    )


def run_trainer(out: Path, spec: dict[str, Any], world_size: int = 2, **kw: Any) -> Run:
    return Gang(out, spec, world_size, **kw).wait()


def rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest relative difference over the steps both trajectories have."""
    common = sorted(set(a) & set(b))
    assert common, "no common steps"
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in common)


def resumed_losses(runs: dict[str, Run], name: str, every: int, steps: int) -> float:
    """layout_runs' `<name>_fail` gang (rank 1 killed) and its next generation: checks that the kill was rank
    1's exit 137, that the gang resumed from step `every` and trained every later step up to `steps`; returns
    the largest relative loss difference from the uninterrupted `<name>` run."""
    failed, resumed = runs[f"{name}_fail"], runs[f"{name}_resumed"]
    assert failed.exit_codes[1] == 137
    assert resumed.exit_codes == [0] * len(resumed.exit_codes), resumed.log(0)[-3000:]
    assert resumed.progress["resumedFrom"] == every
    gen1 = {r["step"]: r["loss"] for r in resumed.records if r["generation"] == 1}
    assert sorted(gen1) == list(range(every + 1, steps + 1))
    diff = rel_diff(gen1, runs[name].losses)
    print(f"{name} resumed at step {every} vs uninterrupted: max relative loss difference {diff:.2e}")
    return diff


Layouts = dict[str, tuple[dict[str, Any], int]]
"""name -> (spec, world size)."""


def layout_runs(root: Path, layouts: Layouts, failing: str | None, fail_at: str, resharded: dict[str, str],
                later: Layouts | None = None, env: dict[str, str] | None = None) -> dict[str, Run]:
    """The parallel layouts' campaign (tests/e2e/test_*_parallel*.py), two waves on the few cores there are: every
    layout, and `failing` (unless None) once more with KUBETRAIN_FAIL_AT=`fail_at` (name `<failing>_fail`); then
    that gang's next generation (`<failing>_resumed`), the `later` layouts, and each `resharded` run's step-10
    checkpoint resumed by one process with its reference's spec (`<name>_to_one`)."""
    env = env or {}
    gangs = {name: Gang(root / name, spec, world, env=env) for name, (spec, world) in layouts.items()}
    if failing is not None:
        spec, world = layouts[failing]
        gangs[f"{failing}_fail"] = Gang(root / f"{failing}_fail", spec, world, env={**env, contract.FAIL_AT: fail_at})
    done = {name: g.wait() for name, g in gangs.items()}
    gangs = {}
    if failing is not None:
        gangs[f"{failing}_resumed"] = Gang(root / f"{failing}_fail", spec, world, generation=1, env=env)
    gangs.update({name: Gang(root / name, s, w, env=env) for name, (s, w) in (later or {}).items()})
    for name, reference in resharded.items():
        source = done[name]
        failed = [rank for rank, code in enumerate(source.exit_codes) if code] or [0]
        assert not any(source.exit_codes), f"{name} exited {source.exit_codes}:\n{source.log(failed[0])[-3000:]}"
        step10 = root / f"{name}_to_one" / "checkpoints" / "step-00000010"
        shutil.copytree(source.ckpt_dir / "step-00000010", step10)
        gangs[f"{name}_to_one"] = Gang(root / f"{name}_to_one", layouts[reference][0], 1, env=env)
    done.update({name: g.wait() for name, g in gangs.items()})
    return done
