"""The local backend: run a TrainingJob as processes on this machine, no cluster.

Each worker (a pod on Kubernetes) is a group of `procsPerWorker` processes of the
same command a pod runs (the built-in trainer, or spec.command), one per rank, with
the environment a pod's launcher gives them (kubetrain.core.launcher.child_envs). The
supervisor loop observes them, steps the shared lifecycle (kubetrain.core.lifecycle.step)
and carries out its effects: start a generation, stop and restart the whole gang from
the latest checkpoint, succeed, fail, or end at once for a suspended job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from kubetrain.core import contract, hangs, hardware, launcher, owned_dirs
from kubetrain.core import lifecycle as lc
from kubetrain.core.api import FINISHED_PHASES, CheckpointRef, Phase, TrainingJob, TrainingJobSpec, TrainingJobStatus
from kubetrain.core.ports import free_port
from kubetrain.core.progress import Progress, committed_checkpoints, read_progress

PYTHON_WORDS = ("python", "python3")
"""A custom command starting with one of these runs under the interpreter kubetrain runs under."""
STOP_GRACE_SECONDS = 120.0
"""How long Ctrl-C waits for workers to write their SIGTERM checkpoint."""
MAX_PORT = 65535
LOOPBACK = "127.0.0.1"
"""Where a local run's workers serve metrics and meet (MASTER_ADDR): this machine only."""
KILL_GRACE_SECONDS = 3.0
"""How long a gang being restarted gets between SIGTERM and SIGKILL."""
SHM = Path("/dev/shm")
"""Where a local run keeps its checkpoint.memory tier: `kubetrain-<uid>-<pid>-<random>/` (this user's only), kept
across its gang restarts and removed when the run ends."""


def now_utc() -> datetime:
    return datetime.now(UTC)


class LocalRunError(Exception):
    """The run cannot start (e.g. its checkpoint directory cannot be written); the message says why."""


@dataclass
class Proc:
    rank: int
    node_rank: int
    popen: subprocess.Popen[bytes] | launcher.NotStarted
    log: IO[bytes]
    init: str | None = None
    """The init container this process stands for (contract.FETCH_CONTAINER); None: a rank."""


@dataclass
class Generation:
    number: int
    procs: list[Proc]
    started: datetime
    started_monotonic: float
    base_step: int
    """Step of the checkpoint this generation resumed from (0 for a fresh start): the durable tier's newest at
    its start, until rank 0 reports what it loaded (the memory tier's step, say)."""
    guard: hangs.Guard | None = None
    """Hang detection over every rank (restartPolicy.hangDetection), as a pod's launcher keeps over its own."""
    hang: hangs.HangReport | None = None
    """The ranks' report once the gang was found hung (its processes are then killed)."""


@dataclass
class RunOptions:
    output_dir: Path
    workers: int | None = None
    fail_at: tuple[int, int] | None = None
    fresh: bool = False
    summary_json: Path | None = None
    poll_seconds: float = 0.25
    quiet: bool = False
    workdir: Path | None = None
    """--workdir: every process runs in this directory (a pod's spec.workdir), where a relative command resolves."""


@dataclass
class Summary:
    name: str
    phase: str
    reason: str
    message: str
    steps: int
    max_steps: int
    initial_loss: float | None
    final_loss: float | None
    restarts: int
    tokens_per_second: float
    checkpoints: list[int]
    resumed_from: list[int] = field(default_factory=list)
    """The step each restarted or resumed generation started from, in order."""
    resumed_tiers: list[str | None] = field(default_factory=list)
    """Where each of those came from, as rank 0 reported it: memory (checkpoint.memory) or durable; None where
    it did not say (a custom command, or a generation that ended first)."""
    failures: dict[str, int] = field(default_factory=dict)
    wall_seconds: float = 0.0
    output_dir: str = ""
    world_size: int = 0
    network_transport: str | None = None
    """What rank 0 reported: gloo on CPU, or the transport NCCL chose (P2P/SHM on one machine)."""
    goodput: dict[str, Any] = field(default_factory=dict)
    """The lifecycle's goodput bookkeeping (productive and lost seconds, steps redone after restarts)."""
    eval_loss: float | None = None
    """Loss on the held-out text at the last evaluation (spec.evalEverySteps)."""
    best_eval_step: int | None = None
    """Step of the checkpoint with the lowest eval loss (kept; recorded in best-eval.json)."""
    export_dir: str | None = None
    """Where the exported model is (spec.export): a directory, or an s3:// URI with checkpoint.uri."""
    bf16_slowdown: float | None = None
    """A CPU run with precision bf16: the bf16/fp32 matrix-product time ratio (one core) measured before it started."""
    bf16_emulated: bool | None = None
    """A CPU run with precision bf16: whether /proc/cpuinfo lacks AVX512-BF16, AMX and Arm BF16; None: not
    such a run, or no /proc/cpuinfo."""
    preflight: dict[str, Any] | None = None
    """The last generation's preflight with its verdict (status.preflight: per-rank GFLOP/s and exchange time,
    bus bandwidth, slowest and degraded ranks); None: not run (spec.preflight.enabled false, a custom command)."""
    memory: dict[str, Any] | None = None
    """Peak memory per rank of the newest generation that reported it (status.memory: host resident, GPU
    allocated) and what the machine's memory could not hold of its checkpoints; None: not reported (a custom command)."""

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2)


def resolve_spec(job: TrainingJob, manifest_dir: Path, opts: RunOptions) -> TrainingJobSpec:
    """The spec as this run executes it: CLI overrides applied, paths made absolute."""
    spec = job.spec.model_copy(deep=True)
    if opts.workers is not None:
        spec.workers = opts.workers
    data = Path(spec.data.path)
    spec.data.path = str(data if data.is_absolute() else (manifest_dir / data).resolve())
    ckpt = Path(spec.checkpoint.dir) if spec.checkpoint.dir else opts.output_dir / "checkpoints"
    spec.checkpoint.dir = str(ckpt.resolve())
    last_port = spec.metrics_port + spec.world_size - 1  # one host: a metrics port per rank
    if last_port > MAX_PORT:
        raise LocalRunError(f"spec.metricsPort: {spec.world_size} processes on one host need ports "
                            f"{spec.metrics_port}-{last_port}, above {MAX_PORT}: lower metricsPort or run fewer workers")
    return TrainingJobSpec.model_validate(spec.dump())


def worker_command(spec: TrainingJobSpec, python: str = sys.executable) -> list[str]:
    """What every process runs: the built-in trainer, or spec.command + spec.args. A first word `python` or
    `python3` is this interpreter, so the packages kubetrain sees (torch) are there without an activated venv."""
    if not spec.command:
        return [python, "-m", "kubetrain.trainer"]
    command = [*spec.command, *(spec.args or [])]
    if command[0] in PYTHON_WORDS:
        command[0] = python
    return command


def ensure_writable(*dirs: Path) -> None:
    """Create these directories (checkpoints, output) before any process starts, or say why not."""
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LocalRunError(f"cannot create {d}: {exc.strerror or exc}") from None
        if not os.access(d, os.W_OK | os.X_OK):
            raise LocalRunError(f"{d} is not writable")


OUTPUT_ENTRIES = ("logs", "checkpoints", "config.json", contract.PROGRESS_FILE, "losses.jsonl", "summary.json",
                  contract.PROFILE_REQUEST_FILE)
"""What a local run writes into its output directory; a fresh start deletes these (the checkpoints apart)."""
CACHE_ENTRY = "cache"
"""The run's contract.CACHE_DIR (what the fetch step fetched): kept by a fresh start, whose fetch step downloads
again only what changed in the store."""
WRITTEN_TO_OUTPUT = owned_dirs.names(*OUTPUT_ENTRIES, CACHE_ENTRY)
WRITTEN_TO_CHECKPOINTS = owned_dirs.names("best-eval.json", contract.TENSORBOARD_DIR, contract.PROFILES_DIR,
                                          "staging", "restore", pattern=r"^step-\d{8}$")
"""staging/ and restore/: each rank's part of a save before its upload, and the download a resume loads
(checkpoint.uri)."""


def prepare_output_dir(spec: TrainingJobSpec, opts: RunOptions) -> str | None:
    """Start fresh, or resume an unfinished run found there. Returns a line to tell the user.

    Both directories must be kubetrain's own (created by it, or adopted empty): a fresh start clears
    what the run wrote and nothing else (kubetrain.core.owned_dirs)."""
    out, ckpt = opts.output_dir, Path(spec.checkpoint.dir or "")
    try:
        owned_dirs.claim(out, "--output-dir", WRITTEN_TO_OUTPUT)
        owned_dirs.claim(ckpt, "spec.checkpoint.dir", WRITTEN_TO_CHECKPOINTS)
    except owned_dirs.NotOwnedError as exc:
        raise LocalRunError(str(exc)) from None
    previous = read_progress(out)
    done = committed_checkpoints(ckpt)
    if not opts.fresh and previous is not None and not previous.finished and done:
        return f"resuming the unfinished run in {out} from step {done[-1][0]} (pass --fresh to start over)"
    owned_dirs.clear(ckpt)
    owned_dirs.clear(out, only=[n for n in OUTPUT_ENTRIES if (out / n).resolve() != ckpt.resolve()])
    return None


def config_error_said(logs: list[Path]) -> str | None:
    """What a worker that exited CONFIG_ERROR_EXIT_CODE said (its termination message in a pod): the last
    `configuration error: ...` line of its logs."""
    for path in logs:
        with contextlib.suppress(OSError):
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if contract.CONFIG_ERROR_PREFIX in ln]
            if lines:
                return lines[-1][lines[-1].index(contract.CONFIG_ERROR_PREFIX):]
    return None


class StatusLine:
    """One live line: a carriage-return status on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, stream: IO[str], quiet: bool = False):
        self.stream, self.quiet = stream, quiet
        self.tty = stream.isatty()
        self.last_text = ""
        self.last_print = 0.0

    def show(self, text: str, now: float) -> None:
        if self.quiet or text == self.last_text:
            return
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
        elif now - self.last_print >= 5.0:
            self.stream.write(text + "\n")
            self.stream.flush()
            self.last_print = now
        self.last_text = text

    def say(self, text: str) -> None:
        if self.tty and self.last_text:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()
        self.last_text = ""


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def progress_text(p: Progress | None, gen: int, restarts: int, started: float, base_step: int, now: float) -> str:
    """The live line: bar, step, loss, throughput, ETA from this generation's pace."""
    if p is None or p.step <= base_step or p.generation != gen:
        return f"gen {gen} | starting {f'from step {base_step}' if base_step else 'workers'} ... {now - started:.0f}s"
    width = 24
    filled = int(width * p.step / max(1, p.max_steps))
    bar = "#" * filled + "." * (width - filled)
    loss = f"{p.loss:.4f}" if p.loss is not None else "-"
    if p.eval_loss is not None:
        loss += f" (eval {p.eval_loss:.4f})"
    rate = (p.step - base_step) / max(1e-9, now - started)
    eta = _fmt_eta((p.max_steps - p.step) / rate) if rate > 0 else "?"
    return (
        f"[{bar}] step {p.step}/{p.max_steps} | loss {loss} | {p.tokens_per_second:,.0f} tok/s"
        f" | ETA {eta} | gen {gen} restarts {restarts}"
    )


CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")
MEMINFO = Path("/proc/meminfo")


def machine_memory_bytes() -> int | None:
    """The memory a local run's processes share: the cgroup (v2) limit of the container it runs in, where one is
    set, else the machine's MemTotal; None where neither can be read."""
    found = []
    with contextlib.suppress(OSError, ValueError):
        raw = CGROUP_MEMORY_MAX.read_text().strip()
        if raw != "max":
            found.append(int(raw))
    with contextlib.suppress(OSError, ValueError, IndexError):
        line = next(x for x in MEMINFO.read_text().splitlines() if x.startswith("MemTotal:"))
        found.append(int(line.split()[1]) * 1024)
    return min(found) if found else None


def shm_bytes() -> int | None:
    """/dev/shm's size, where there is one."""
    try:
        size = os.statvfs(SHM)
    except OSError:
        return None
    return size.f_blocks * size.f_frsize


class LocalRun:
    """Supervise one TrainingJob as local processes until it succeeds, fails, is suspended or is stopped.

    An adapter of the lifecycle, as the operator is: observe the processes -> lifecycle.step -> carry
    out its effects. The job's status lives in memory here as it lives in the API server there.
    """

    def __init__(self, job: TrainingJob, manifest_dir: Path, opts: RunOptions):
        self.job = job
        self.name = job.metadata.name
        self.run_id = f"local-{uuid.uuid4().hex[:12]}"
        """contract.RUN_ID: this run's claim on its checkpoints, as a TrainingJob's uid is in a cluster."""
        self.opts = opts
        self.spec = resolve_spec(job, manifest_dir, opts)
        self.out = opts.output_dir.resolve()
        self.config_path = self.out / "config.json"
        self.line = StatusLine(sys.stderr, opts.quiet)
        self.job_status = TrainingJobStatus()
        self.gen: Generation | None = None
        self.resumed: dict[int, tuple[int, str | None]] = {}
        """generation -> (step, tier) it resumed from: the durable tier's newest at its start, then its report."""
        self.memory_dir: Path | None = None
        self.bf16_slowdown: float | None = None
        self.bf16_emulated: bool | None = None
        self.stop_requested = False

    # ------------------------------------------------------------------ processes

    def _start_generation(self, number: int, indices: tuple[int, ...], now: datetime) -> None:
        spec = self.spec
        port = free_port(host=LOOPBACK)
        logs = self.out / "logs" / f"gen-{number}"
        ensure_writable(Path(spec.checkpoint.dir or ""), self.out, logs)
        self.config_path.write_text(json.dumps(spec.dump(), indent=1))
        latest = committed_checkpoints(Path(spec.checkpoint.dir or ""))
        base_step = latest[-1][0] if latest else 0
        if latest:
            self.resumed[number] = (base_step, None)
        fetch = self._fetch(logs, self._worker_env(0, number, port))
        if fetch is not None and fetch.popen.poll() != 0:  # every worker failed as its pod's init container would
            self.gen = Generation(number, [dataclasses.replace(fetch, node_rank=i) for i in indices], now,
                                  time.monotonic(), base_step)
            return
        command = worker_command(spec)
        procs = []
        limits = spec.hang_limits
        watch = hangs.prepare(str(self.out / "hang-watch"), os.environ) if limits is not None else {}
        if watch:
            hangs.clear_beats(watch[contract.HEARTBEAT_DIR])  # before any rank of this generation starts
        for node_rank in indices:
            for child_env in launcher.child_envs({**self._worker_env(node_rank, number, port), **watch}):
                rank = int(child_env[contract.RANK])
                log = open(logs / f"rank-{rank}.log", "wb")  # noqa: SIM115 - closed in _stop_all
                popen = launcher.start(  # a command that cannot start: exit 127/126 and one line in the log
                    command, child_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C reaches the supervisor only; it stops workers in order
                    cwd=self.opts.workdir,
                )
                procs.append(Proc(rank, node_rank, popen, log))
        self.gen = Generation(number, procs, now, time.monotonic(), base_step)
        if limits is not None:
            self.gen.guard = hangs.Guard(limits, watch[contract.HEARTBEAT_DIR], str(logs / "hang"))

    def _fetch(self, logs: Path, env: dict[str, str]) -> Proc | None:
        """The fetch step (model.hfUri, data.tokenizerUri into the cache), run to its end with rank 0's environment
        as a pod's init container runs it; its output goes to `fetch.log`. None: the job fetches nothing."""
        if not self.spec.fetched_uris():
            return None
        self.line.say(f"fetching {', '.join(self.spec.fetched_uris())} into {env[contract.CACHE_DIR]} ...")
        log = open(logs / "fetch.log", "wb")  # noqa: SIM115 - closed in _stop_all, as the ranks' logs
        popen = launcher.start([sys.executable, "-m", contract.FETCH_MODULE], env, stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        popen.wait()
        return Proc(0, 0, popen, log, init=contract.FETCH_CONTAINER)

    def _worker_env(self, node_rank: int, number: int, port: int) -> dict[str, str]:
        """One worker's environment, as a pod's: launcher.child_envs() makes each rank's from it."""
        spec = self.spec
        env = dict(os.environ)
        for var, value in contract.thread_env(os.cpu_count() or 1, spec.world_size).items():
            env.setdefault(var, value)  # every rank of every worker shares this machine's cores
        env[contract.METRICS_ADDR] = LOOPBACK
        env.update(contract.torch_env(contract.WorkerPlacement(node_rank, 0, spec.procs, spec.workers), LOOPBACK, port))
        env.update(
            contract.kubetrain_env(
                job=self.name,
                namespace="local",
                config_path=str(self.config_path),
                checkpoint_dir=str(spec.checkpoint.dir),
                output_dir=str(self.out),
                restart_generation=number,
                metrics_port=spec.metrics_port + node_rank * spec.procs,  # one host: a port per rank
                run_id=self.run_id,
                hang=hangs.setting(spec.hang_limits),
                memory_tier=self._memory_tier(),
                cache_dir=str(self.out / CACHE_ENTRY),
            )
        )
        env.update(contract.memory_env(machine_memory_bytes(), shm_bytes(), spec.world_size))  # one machine, shared
        for item in spec.env or []:
            if "name" in item and "value" in item:
                env[str(item["name"])] = str(item["value"])
        if number == 0 and self.opts.fail_at is not None:
            env[contract.FAIL_AT] = f"{self.opts.fail_at[0]}:{self.opts.fail_at[1]}"
        else:
            env.pop(contract.FAIL_AT, None)
        return env

    def _make_memory_tier(self) -> None:
        """checkpoint.memory's directory for the whole run (its ranks keep `rank-<R>/` there); none where
        /dev/shm is missing."""
        if self.spec.checkpoint.memory.enabled and self.memory_dir is None and SHM.is_dir():
            self.memory_dir = Path(tempfile.mkdtemp(prefix=f"kubetrain-{os.getuid()}-{os.getpid()}-", dir=SHM))

    def _memory_tier(self) -> contract.MemoryTier | None:
        """checkpoint.memory for this run's ranks, with a budget per rank out of /dev/shm's size."""
        if self.memory_dir is None:
            return None
        size = os.statvfs(SHM)
        tier = self.spec.checkpoint.memory
        return contract.MemoryTier(str(self.memory_dir), tier.every_steps,
                                   tier.budget_bytes(size.f_blocks * size.f_frsize, self.spec.world_size))

    def _remove_memory_tier(self) -> None:
        if self.memory_dir is not None:
            shutil.rmtree(self.memory_dir, ignore_errors=True)
            self.memory_dir = None

    def _signal_all(self, sig: int) -> None:
        for p in self.gen.procs if self.gen else []:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, sig)

    def _wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for p in self.gen.procs if self.gen else []:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def _stop_all(self, grace: float) -> None:
        """SIGTERM every worker (they checkpoint if they can), SIGKILL what is left after `grace`."""
        self._signal_all(signal.SIGTERM)
        if not self._wait_all(grace):
            self._signal_all(signal.SIGKILL)
            self._wait_all(10.0)
        for p in self.gen.procs if self.gen else []:
            p.log.close()

    # ------------------------------------------------------------------ observe

    def _last_checkpoint(self, progress: Progress | None) -> CheckpointRef | None:
        """The newest complete checkpoint. Local checkpoints live in one directory that outlives every
        generation, so Observed.checkpoints_durable keeps its default (spec.checkpoint.ephemeral is for pods)."""
        if self.spec.checkpoint.uri:  # in object storage: rank 0 reports each commit
            record = progress.last_checkpoint if progress is not None else None
            return CheckpointRef(step=record.step, path=record.path, time=record.time) if record else None
        done = committed_checkpoints(Path(self.spec.checkpoint.dir or ""))
        return CheckpointRef(step=done[-1][0], path=str(done[-1][1])) if done else None

    def _watch_hangs(self) -> None:
        """Hang detection over every rank: on a verdict, save their stacks, say so, and kill them."""
        gen = self.gen
        if gen is None or gen.guard is None or gen.hang is not None:
            return
        pids = {p.rank: p.popen.pid for p in gen.procs if p.popen.poll() is None}
        report = gen.guard.hung(pids, time.monotonic()) if pids else None
        if report is None:
            return
        gen.hang = gen.guard.save(report)
        for line in hangs.report_lines(gen.hang, hangs.verdict(gen.hang.ranks, range(self.spec.world_size)))[1:]:
            self.line.say(line)
        self._signal_all(signal.SIGKILL)
        self._wait_all(10.0)

    def _worker_state(self, node_rank: int) -> lc.WorkerState:
        """A process group as the lifecycle sees a pod: failed with the root cause, succeeded, or running."""
        group = [p for p in self.gen.procs if p.node_rank == node_rank] if self.gen else []
        if self.gen is not None and self.gen.hang is not None:
            ranks = {p.rank for p in group}
            mine = tuple(r for r in self.gen.hang.ranks if r.rank in ranks)
            return lc.WorkerState(node_rank, lc.WorkerPhase.FAILED, exit_code=contract.HUNG_EXIT_CODE,
                                  hang=dataclasses.replace(self.gen.hang, ranks=mine))
        codes = [p.popen.poll() for p in group]
        failed = [contract.exit_code(c) for c in codes if c is not None and c != 0]
        if failed:
            code = contract.root_cause(failed)
            said = config_error_said([Path(p.log.name) for p in group]) \
                if code == contract.CONFIG_ERROR_EXIT_CODE else None
            return lc.WorkerState(node_rank, lc.WorkerPhase.FAILED, exit_code=code, said=said,
                                  failed_in=next((p.init for p in group if p.init), None))
        if all(c == 0 for c in codes):
            return lc.WorkerState(node_rank, lc.WorkerPhase.SUCCEEDED, exit_code=0)
        return lc.WorkerState(node_rank, lc.WorkerPhase.RUNNING)

    def observe(self) -> lc.Observed:
        self._watch_hangs()
        gen, current = self.gen, self.job_status.restart_generation
        ranks = sorted({p.node_rank for p in gen.procs}) if gen is not None and gen.number == current else []
        progress = read_progress(self.out)
        if gen is not None and progress is not None and progress.generation == gen.number and \
                progress.resumed_from is not None:
            self.resumed[gen.number] = (progress.resumed_from, progress.resumed_tier)
            gen.base_step = progress.resumed_from
        return lc.Observed(
            workers=tuple(self._worker_state(i) for i in ranks),
            stale_workers=len(gen.procs) if gen is not None and gen.number != current else 0,
            progress=progress,
            checkpoint=self._last_checkpoint(progress),
        )

    # ------------------------------------------------------------------ act

    def carry_out(self, t: lc.Transition, now: datetime) -> None:
        """Every effect of one lifecycle step: events are told first, then processes start or stop."""
        for effect in t.effects:
            if isinstance(effect, lc.RecordEvent):
                self._tell(effect, t.decision)
        for effect in t.effects:
            if isinstance(effect, lc.CreateWorkers):
                self._start_generation(effect.generation, effect.indices, now)
            elif isinstance(effect, lc.DeleteWorkers):
                self._delete(effect.scope, t.decision)
            # DeleteJob: a local run keeps its output directory; it ends when the job finishes.

    def _tell(self, event: lc.RecordEvent, d: lc.Decision | None) -> None:
        if d is not None and d.action == lc.Action.RESTART_GANG:
            self.line.say(f"restarting: {event.message}")
        else:
            self.line.say(f"{event.reason}: {event.message}")

    def _delete(self, scope: lc.Scope, d: lc.Decision | None) -> None:
        """Stop the workers in scope. Processes that exited stay exited, so every scope stops what still runs;
        Stale only when this generation is an older one; Restarting never (no local process restarts itself)."""
        if self.gen is None or scope == lc.Scope.RESTARTING or \
                (scope == lc.Scope.STALE and self.gen.number == self.job_status.restart_generation):
            return
        if d is not None:
            self._tail_failed_logs(d.failed_workers)
        self._stop_all(KILL_GRACE_SECONDS)
        self.gen = None

    def _tail_failed_logs(self, workers: tuple[int, ...]) -> None:
        if self.gen is None:
            return
        shown: set[str] = set()
        for p in self.gen.procs:
            if p.node_rank in workers and p.popen.poll() not in (None, 0) and p.log.name not in shown:
                shown.add(p.log.name)
                p.log.flush()
                lines = Path(p.log.name).read_text(errors="replace").splitlines()[-8:]
                self.line.say(f"--- last lines of {p.init or f'rank {p.rank}'} ({p.log.name}) ---")
                for line in lines:
                    self.line.say("  " + line)

    # ------------------------------------------------------------------ main loop

    def run(self) -> Summary:
        t0 = time.monotonic()
        note = prepare_output_dir(self.spec, self.opts)
        self._say_start(note)
        previous = signal.signal(signal.SIGINT, self._on_interrupt)
        previous_term = signal.signal(signal.SIGTERM, self._on_interrupt)
        try:
            self._make_memory_tier()
            self._loop(t0)
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGTERM, previous_term)
            self._stop_all(KILL_GRACE_SECONDS)  # processes never outlive the run, whatever cleanPodPolicy says
            self._remove_memory_tier()
        summary = self._summary(time.monotonic() - t0)
        (self.out / "summary.json").write_text(summary.to_json())
        if self.opts.summary_json:
            Path(self.opts.summary_json).parent.mkdir(parents=True, exist_ok=True)
            Path(self.opts.summary_json).write_text(summary.to_json())
        return summary

    def _say_start(self, note: str | None) -> None:
        spec = self.spec
        self.line.say(
            f"kubetrain: running TrainingJob {self.name!r} locally: {spec.workers} worker(s) x "
            f"{spec.procs} process(es), strategy {spec.strategy}, precision {spec.precision}, {spec.max_steps} steps"
        )
        if note:
            self.line.say(note)
        self.line.say(f"output: {self.out} (logs/, checkpoints/, progress.json)")
        if spec.checkpoint.ephemeral:
            self.line.say("checkpoint.ephemeral applies to pods only: local checkpoints survive restarts")
        self._check_bf16()
        ports = f"{spec.metrics_port}-{spec.metrics_port + spec.world_size - 1}"
        self.line.say(f"metrics: http://{LOOPBACK}:{ports}/metrics (one port per rank, Prometheus format)")

    def _check_bf16(self) -> None:
        """A CPU run with precision bf16: how much slower bf16 is here, said before the first step."""
        if self.spec.precision != "bf16" or Path("/proc/driver/nvidia").exists():  # workers train on the GPU
            return
        native = hardware.this_cpu_native_bf16()
        self.bf16_emulated = None if native is None else not native
        self.bf16_slowdown = hardware.bf16_slowdown()
        if notice := hardware.bf16_notice(self.bf16_slowdown, native):
            self.line.say(notice)

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def _loop(self, t0: float) -> None:
        """Step the lifecycle until the job is finished or suspended (nothing left running), or Ctrl-C."""
        while not self.stop_requested:
            now = now_utc()
            t = lc.step(self.spec, self.job_status, self.observe(), now)
            self.job_status = t.status
            self.carry_out(t, now)
            if t.status.phase in FINISHED_PHASES or (t.status.phase == Phase.SUSPENDED and self.gen is None):
                return
            self._show(t0)
            time.sleep(self.opts.poll_seconds)
        self.line.say("stopping: asking workers to checkpoint and exit (Ctrl-C again is ignored) ...")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._stop_all(STOP_GRACE_SECONDS)
        self._end_stopped()

    def _end_stopped(self) -> None:
        """Suspended after Ctrl-C, unless the workers had finished when it came: then the job Succeeded, and a
        rerun (a sweep resuming its trial) does not train it again."""
        now = now_utc()
        t = lc.step(self.spec, self.job_status, self.observe(), now)
        if t.status.phase == Phase.SUCCEEDED:
            self.job_status = t.status
            self.carry_out(t, now)
            return
        self.job_status = self.job_status.model_copy(update={
            "phase": Phase.SUSPENDED, "reason": lc.Reason.INTERRUPTED, "message": "stopped by the user; run again to resume"})

    def _show(self, t0: float) -> None:
        g, mono = self.gen, time.monotonic()
        line = progress_text(
            read_progress(self.out) if g else None, self.job_status.restart_generation, self.job_status.restart_count,
            g.started_monotonic if g else t0, g.base_step if g else 0, mono,
        )
        self.line.show(line, mono)

    def _summary(self, wall: float) -> Summary:
        p, st = read_progress(self.out) or Progress(), self.job_status
        return Summary(
            name=self.name,
            phase=st.phase,
            reason=st.reason,
            message=st.message,
            steps=p.step,
            max_steps=p.max_steps or self.spec.max_steps,  # a custom command reports its own
            initial_loss=p.initial_loss,
            final_loss=p.loss,
            restarts=st.restart_count,
            tokens_per_second=p.tokens_per_second,
            checkpoints=list(p.checkpoints),
            resumed_from=[step for _, (step, _) in sorted(self.resumed.items())],
            resumed_tiers=[tier for _, (_, tier) in sorted(self.resumed.items())],
            failures=dict(st.failures),
            wall_seconds=round(wall, 2),
            output_dir=str(self.out),
            world_size=self.spec.world_size,
            network_transport=p.network_transport,
            goodput=st.goodput.model_dump(exclude={"generation", "restarted_at"}),
            eval_loss=p.eval_loss,
            best_eval_step=p.best_eval_step,
            export_dir=p.export,
            bf16_slowdown=self.bf16_slowdown,
            bf16_emulated=self.bf16_emulated,
            preflight=st.preflight.dump() if st.preflight else None,
            memory=st.memory.dump() if st.memory else None,
        )
