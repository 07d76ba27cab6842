"""checkpoint.memory: each rank keeps its own part of the newest state in memory that outlives its process.

The directory is contract.MEMORY_CKPT_DIR (a pod's /dev/shm, which a restart in place keeps; locally a
directory under /dev/shm that the run keeps across its gang restarts). Every `every_steps` optimizer steps
each rank writes, without any collective::

    <dir>/rank-<R>/step-NNNNNNNN/
      state.pt       the engine's local state: model and optimizer (FSDP2: this rank's shards of the
                     DTensors; DDP: the full replicated state), LR scheduler, loss scaler; and this rank's RNG
      powersgd/      ddp with gradientCompression powersgd: the hook's state (this rank's)
      trainer.json   the trainer state (step, data position, ...)
      COMMITTED      written last, atomically (temp + os.replace): {step, rank, worldSize, strategy, bytes}

and then deletes every other step directory of its own: it keeps the newest complete step while it writes
the next, so it holds at most two copies. The write leaves the step: inside it the rank only copies its state
into a host snapshot it reuses from save to save (:class:`Snapshot`; pinned, non-blocking copies on CUDA), and
a thread writes the files from that snapshot while training goes on (one write in flight: the next due save
first waits for it). Only tensors and plain containers are saved, and read back with
``torch.load(weights_only=True)`` (checkpoint.safe_load).

On resume (manager.CheckpointManager.resume) the gang agrees, in one all_gather_object, on the newest
step that every rank holds complete; when it is at least the durable tier's newest committed step, every
rank loads its own part of it. A recreated pod has an empty /dev/shm, so that gang finds no common step and
resumes from the durable tier. The pure decisions are :func:`common_step` and :func:`choose_tier`; whether the
gang keeps the tier at all, and each rank's budget, is budget.plan_gang's, over the pod's memory.

DeepSpeed keeps no memory tier: its checkpoints are written by DeepSpeed's engine, whose files of one rank
are not a whole state of that rank (ZeRO's model states are written once, by data-parallel rank 0).
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kubetrain.core import contract, hangs
from kubetrain.core.api import ResumeTier, TrainingJobSpec
from kubetrain.core.progress import COMMIT_MARKER, atomic_write_text, checkpoint_dirname, complete_checkpoints
from kubetrain.trainer.checkpoint.directory import TRAINER_STATE, TrainerState, now_rfc3339, rng_state, set_rng_state
from kubetrain.trainer.checkpoint.safe_load import safe_load
from kubetrain.trainer.checkpoint.savable import LocalState, Savable

log = logging.getLogger("kubetrain.trainer")

STATE_FILE = "state.pt"
OPTIMIZER_STATES_PER_PARAM = 2
"""AdamW's exp_avg and exp_avg_sq, each the size of its parameter (shard)."""
SLACK_BYTES = 1 << 20
"""Beyond the tensors: the RNG, scheduler and trainer state, the pickle's framing."""
CLOSE_WAIT_SECONDS = 60.0
"""At exit, how long a rank waits for its write in flight (to memory: normally well under a second)."""


def rank_dir(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank}"


# --------------------------------------------------------------------------- pure decisions


def common_step(held: Sequence[Sequence[int] | None]) -> int | None:
    """The newest step every rank holds complete (each rank's list of steps; None: the rank keeps no tier)."""
    if not held or any(h is None for h in held):
        return None
    common = set(held[0] or ())
    for steps in held[1:]:
        common &= set(steps or ())
    return max(common) if common else None


def choose_tier(memory_step: int | None, durable_step: int | None) -> ResumeTier | None:
    """Where the gang resumes from: the memory tier when it holds a step at least as new as the durable tier's
    newest (its load is the faster), else the durable tier; None: neither holds anything (a fresh start)."""
    if memory_step is not None and (durable_step is None or memory_step >= durable_step):
        return "memory"
    return "durable" if durable_step is not None else None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class TierSettings:
    """The tier as the contract passes it to a rank (MEMORY_CKPT_DIR, _EVERY, _BYTES)."""

    directory: Path
    every_steps: int
    budget_bytes: int | None
    sharing: int = 1
    """Processes that write into the same directory's file system (MEMORY_PROCS, else LOCAL_WORLD_SIZE)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str], spec: TrainingJobSpec) -> TierSettings | None:
        """None where the tier is off (MEMORY_CKPT_DIR unset or empty). Malformed numbers fall back to the
        spec's period and to no budget (the free space still bounds it)."""
        directory = environ.get(contract.MEMORY_CKPT_DIR)
        if not directory:
            return None

        def number(name: str) -> int | None:
            try:
                value = int(environ.get(name) or "")
            except ValueError:
                return None
            return value if value > 0 else None

        return cls(
            directory=Path(directory),
            every_steps=number(contract.MEMORY_CKPT_EVERY) or spec.checkpoint.memory.every_steps,
            budget_bytes=number(contract.MEMORY_CKPT_BYTES),
            sharing=number(contract.MEMORY_PROCS) or number(contract.LOCAL_WORLD_SIZE) or 1,
        )


# --------------------------------------------------------------------------- the engine's local state


class Snapshot:
    """Host buffers for one rank's state, reused from save to save: the copy a tier save makes inside the step
    (pinned buffers and non-blocking copies, then one synchronize, on CUDA), which its background write reads.
    Every DTensor becomes this rank's local shard; a tensor met twice is copied once; a buffer is contiguous
    and its own storage (torch.save writes a view's whole storage)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.buffers: list[torch.Tensor] = []
        self._next = 0
        self._seen: dict[int, torch.Tensor] = {}

    def take(self, tree: Any) -> Any:
        """``tree`` with every tensor copied into its buffer and every other value copied."""
        self._next, self._seen = 0, {}
        out = self._walk(tree)
        del self.buffers[self._next:]
        self._seen = {}
        if self.pinned:
            torch.cuda.synchronize()
        return out

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def _walk(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._walk(v) for v in value)
        if isinstance(value, torch.Tensor):
            if id(value) not in self._seen:
                self._seen[id(value)] = self._copy(value)
            return self._seen[id(value)]
        return copy.deepcopy(value)

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        local = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach()
        i, self._next = self._next, self._next + 1
        if i < len(self.buffers) and (self.buffers[i].shape, self.buffers[i].dtype) == (local.shape, local.dtype):
            buffer = self.buffers[i]
        else:
            buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.pinned)
            self.buffers[i:i + 1] = [buffer]
        buffer.copy_(local, non_blocking=self.pinned)
        return buffer


class MemoryStateMismatchError(RuntimeError):
    """A saved local state that does not fit this rank's engine (another model or layout)."""


def _fill(template: Any, saved: Any, where: str) -> Any:
    """`template` (get_state_dict's, this engine's live layout) with `saved`'s values: tensors are copied in
    place (a DTensor's local shard), every other value is the saved one."""
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise MemoryStateMismatchError(f"{where}: saved {type(saved).__name__}, not a tensor")
        local = template.to_local() if hasattr(template, "to_local") else template
        if local.shape != saved.shape:
            raise MemoryStateMismatchError(f"{where}: saved shape {tuple(saved.shape)}, this rank holds "
                                           f"{tuple(local.shape)}")
        with torch.no_grad():
            local.copy_(saved)
        return template
    if isinstance(template, dict):
        if not isinstance(saved, dict) or set(saved) != set(template):
            raise MemoryStateMismatchError(f"{where}: saved keys differ from this rank's")
        return {k: _fill(template[k], saved[k], f"{where}.{k}") for k in template}
    if isinstance(template, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(template):
            raise MemoryStateMismatchError(f"{where}: saved length differs from this rank's")
        return type(template)(_fill(t, s, f"{where}[{i}]") for i, (t, s) in enumerate(zip(template, saved, strict=True)))
    return saved


def live_state(engine: LocalState) -> dict[str, Any]:
    """This rank's own part of the engine's state as the engine holds it (no copy), collective-free."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415

    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "scheduler": engine.scheduler.state_dict()}
    if engine.scaler is not None:
        state["scaler"] = engine.scaler.state_dict()
    return state


def load_engine_state(engine: LocalState, saved: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415

    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    model_sd = _fill(model_sd, saved["model"], "model")
    optim_sd = _fill(optim_sd, saved["optim"], "optim")
    set_state_dict(engine.model, engine.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    engine.scheduler.load_state_dict(saved["scheduler"])
    if engine.scaler is not None and "scaler" in saved:
        engine.scaler.load_state_dict(saved["scaler"])


def estimate_bytes(engine: LocalState) -> int:
    """This rank's state in bytes before any is saved: its parameters (shards), AdamW's two states of each that
    trains (spec.lora: the adapters only), PowerSGD's error feedback (a gradient's size), and some slack."""
    params = trained = 0
    for p in engine.model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        params += t.numel() * t.element_size()
        trained += t.numel() * t.element_size() if p.requires_grad else 0
    per_trained = OPTIMIZER_STATES_PER_PARAM + (1 if engine.compression is not None else 0)
    return params + trained * per_trained + SLACK_BYTES


def free_bytes(path: Path) -> int:
    """The free space of the file system `path` is (or will be, once created) on."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- the tier


@dataclass(frozen=True)
class Offer:
    """What one rank brings to the resume agreement (sent with all_gather_object)."""

    steps: tuple[int, ...] | None
    """The steps this rank holds complete; None where it keeps no tier."""
    fits: bool
    """Its directory can be used (False: its file system cannot even be read; the gang then keeps no tier)."""
    held_bytes: int = 0
    """What those steps take in the directory."""
    free_bytes: int | None = None
    """The directory's free space."""


@dataclass
class PendingWrite:
    """A tier save whose files a thread writes from the snapshot."""

    step: int
    path: Path
    future: Future[tuple[int, float]]
    """The bytes written and the seconds the write took, once committed."""
    stall: float
    """Seconds the step stopped for it (waiting for the previous write, the snapshot)."""


class MemoryTier:
    """One rank's memory tier (collective-free). Built only for strategies ddp and fsdp."""

    def __init__(self, settings: TierSettings, engine: LocalState, rank: int, world_size: int, strategy: str,
                 device: torch.device | None = None):
        self.settings = settings
        self.engine = engine
        self.rank = rank
        self.world_size = world_size
        self.strategy = strategy
        self.root = rank_dir(settings.directory, rank)
        self.active = True
        self.budget_bytes = settings.budget_bytes
        """This rank's budget for its two copies (the gang's plan sets it at resume: budget.plan_gang)."""
        self.last_bytes: int | None = None
        self.skip_warned = False
        self.snapshot = Snapshot(pinned=device is not None and device.type == "cuda")
        self.pending: PendingWrite | None = None
        self._writer: ThreadPoolExecutor | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str], spec: TrainingJobSpec, engine: Savable, rank: int,
                 world_size: int) -> MemoryTier | None:
        settings = TierSettings.from_env(environ, spec)
        if settings is None:
            return None
        local = engine.local_state()
        if local is None:
            if rank == 0:
                log.info("checkpoint.memory is off for strategy %s (DeepSpeed writes its own checkpoints, not "
                         "one per rank): every restart resumes from the durable tier", spec.strategy)
            return None
        return cls(settings, local, rank, world_size, spec.strategy, engine.device)

    # -- what this rank holds

    def held(self) -> list[tuple[int, Path]]:
        """(step, path) of this rank's complete steps saved by this gang's shape (world size, strategy)."""
        found = []
        for step, path in complete_checkpoints(self.root):
            try:
                marker = json.loads((path / COMMIT_MARKER).read_text())
            except (OSError, ValueError):
                continue
            if (marker.get("rank"), marker.get("worldSize"), marker.get("strategy")) == \
                    (self.rank, self.world_size, self.strategy):
                found.append((step, path))
        return found

    def offer(self) -> Offer:
        held = self.held()
        steps = tuple(s for s, _ in held)
        try:
            free = free_bytes(self.settings.directory)
        except OSError as exc:
            log.warning("checkpoint.memory is off: %s: %s; restarts resume from the durable tier",
                        self.settings.directory, exc)
            return Offer(steps, False)
        return Offer(steps, True, sum(tree_bytes(p) for _, p in held), free)

    def state_bytes(self) -> int:
        return estimate_bytes(self.engine)

    # -- resume

    def load(self, step: int) -> TrainerState:
        """This rank's part of `step` into the engine and the RNG; the trainer state saved with it. Where it
        cannot be loaded this rank's tier is removed, so that the next generation resumes from the durable tier."""
        path = self.root / checkpoint_dirname(step)
        try:
            saved = safe_load(path / STATE_FILE)
            load_engine_state(self.engine, saved["engine"])
            if self.engine.compression is not None:
                self.engine.compression.load(path)
            set_rng_state(saved["rng"])
            return TrainerState.from_json(json.loads((path / TRAINER_STATE).read_text()))
        except Exception as exc:
            self.remove()
            raise RuntimeError(f"checkpoint.memory: cannot load {path} ({exc}); removed this rank's memory tier, "
                               "so the next generation resumes from the durable tier") from exc

    def keep_only_up_to(self, step: int) -> None:
        """After the gang resumed from `step` (0: from scratch): steps after it belong to an abandoned lineage."""
        for held, path in complete_checkpoints(self.root):
            if held > step:
                shutil.rmtree(path, ignore_errors=True)

    def turn_off(self) -> None:
        """The tier is off on this rank from now on: nothing of it stays in memory (a write in flight ends first)."""
        self.active = False
        self.collect(wait=True)
        self.snapshot = Snapshot(self.snapshot.pinned)
        self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def close(self) -> None:
        """At exit, however it comes: the write in flight may end (bounded; it writes to memory), so that the
        newest step it holds is complete. One that does not end in time stays torn, which resume ignores."""
        self.collect(wait=True, timeout=CLOSE_WAIT_SECONDS)
        if self._writer is not None:
            self._writer.shutdown(wait=False)
            self._writer = None

    # -- saving

    def due(self, step: int, *, final: bool) -> bool:
        return self.active and not final and step % self.settings.every_steps == 0

    def maybe_save(self, state: TrainerState, *, final: bool) -> Path | None:
        """When due (no collective): wait for the previous write (normally long done), copy this rank's state
        into the snapshot and start writing it in the background. The directory being written, or None."""
        if not self.due(state.step, final=final):
            return None
        hangs.write_beat(state.step, hangs.CHECKPOINT, force=True)
        try:
            t0 = time.perf_counter()
            self.collect(wait=True)
            return self._start(state, t0) if self.active and self._room_for(state.step) else None
        finally:
            hangs.write_beat(state.step, force=True)  # judged as training again

    def _room_for(self, step: int) -> bool:
        """The free space holds this rank's share of a new copy; where it does not, the step is skipped."""
        expected = self.last_bytes or estimate_bytes(self.engine)
        try:
            free = free_bytes(self.settings.directory)
        except OSError:
            free = 0
        if expected <= free // max(1, self.settings.sharing):
            return True
        if not self.skip_warned:
            log.warning("checkpoint.memory: step %d not kept: %s free in %s, this rank's state takes %s "
                        "(said once; later steps are skipped alike while it stays full)", step,
                        _mib(free), self.settings.directory, _mib(expected))
            self.skip_warned = True
        return False

    def _start(self, state: TrainerState, t0: float) -> Path | None:
        """Inside the step: the snapshot (and PowerSGD's state, written at once); then the write goes on alone."""
        path = self.root / checkpoint_dirname(state.step)
        try:
            if path.exists():  # a torn write of the same step, by an earlier generation
                shutil.rmtree(path)
            path.mkdir(parents=True, mode=0o700)
            snapshot = self.snapshot.take(live_state(self.engine))
            if self.engine.compression is not None:
                self.engine.compression.save(path)
        except OSError as exc:
            self._off(path, exc)
            return None
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kubetrain-memory-tier")
        future = self._writer.submit(self._write, path, state.step, {"engine": snapshot, "rng": rng_state()},
                                     json.dumps(asdict(state)))
        self.pending = PendingWrite(state.step, path, future, stall=time.perf_counter() - t0)
        return path

    def _write(self, path: Path, step: int, saved: dict[str, Any], trainer_state: str) -> tuple[int, float]:
        """The writer thread: the files, COMMITTED last, then this rank's other steps go."""
        t0 = time.perf_counter()
        try:
            torch.save(saved, path / STATE_FILE)
            atomic_write_text(path / TRAINER_STATE, trainer_state)
            written = tree_bytes(path)
            marker = {"step": step, "rank": self.rank, "worldSize": self.world_size,
                      "strategy": self.strategy, "bytes": written, "time": now_rfc3339()}
            atomic_write_text(path / COMMIT_MARKER, json.dumps(marker) + "\n")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        for entry in self.root.glob("step-*"):
            if entry != path:
                shutil.rmtree(entry, ignore_errors=True)
        return written, time.perf_counter() - t0

    def collect(self, *, wait: bool, timeout: float | None = None) -> None:
        """Take the outcome of the write in flight once it ended (waiting for it, at most `timeout`, when `wait`):
        a write that failed, or a state bigger than the budget, turns the tier off on this rank."""
        job = self.pending
        if job is None or (not wait and not job.future.done()):
            return
        try:
            written, seconds = job.future.result(timeout=timeout)
        except FutureTimeout:
            log.warning("checkpoint.memory: step %d not kept: its write did not end within %.0f s", job.step,
                        timeout or 0)
            return
        except OSError as exc:
            self.pending = None
            self._off(job.path, exc)
            return
        self.pending = None
        self._kept(job, written, seconds)

    def _kept(self, job: PendingWrite, written: int, seconds: float) -> None:
        budget = self.budget_bytes
        if budget is not None and 2 * written > budget:
            log.warning("checkpoint.memory is off: this rank's state takes %s, two copies exceed its budget of %s; "
                        "restarts resume from the durable tier", _mib(written), _mib(budget))
            self.turn_off()
            return
        self.last_bytes = written
        if self.rank == 0:
            log.info("memory tier step %d kept: %.3f s in the step, written in %.3f s in the background (%s on "
                     "this rank)", job.step, job.stall, seconds, _mib(written))

    def _off(self, path: Path, exc: BaseException) -> None:
        log.warning("checkpoint.memory is off: writing %s failed (%s); restarts resume from the durable tier",
                    path, exc)
        shutil.rmtree(path, ignore_errors=True)
        self.turn_off()
