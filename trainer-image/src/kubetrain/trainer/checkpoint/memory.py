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
the next, so it holds at most two copies. Only tensors and plain containers are saved, and read back with
``torch.load(weights_only=True)`` (checkpoint.safe_load).

On resume (manager.CheckpointManager.resume) the gang agrees, in one all_gather_object, on the newest
step that every rank holds complete; when it is at least the durable tier's newest committed step, every
rank loads its own part of it. A recreated pod has an empty /dev/shm, so that gang finds no common step and
resumes from the durable tier. The pure decisions are :func:`common_step`, :func:`choose_tier` and
:func:`does_not_fit`.

DeepSpeed keeps no memory tier: its checkpoints are written by DeepSpeed's engine, whose files of one rank
are not a whole state of that rank (ZeRO's model states are written once, by data-parallel rank 0).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping, Sequence
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


def does_not_fit(state_bytes: int, budget_bytes: int | None, free_bytes: int, held_bytes: int,
                 sharing: int) -> str | None:
    """Why a rank whose state takes `state_bytes` cannot keep the tier, or None. It holds two copies while it
    writes a new one: both within its budget (MEMORY_CKPT_BYTES), and what it lacks of them (it already
    holds `held_bytes`) within its share of the directory's free space (`sharing` processes write there)."""
    need = 2 * state_bytes
    if budget_bytes is not None and need > budget_bytes:
        return (f"two copies of this rank's state ({_mib(need)}) exceed its budget of {_mib(budget_bytes)} "
                f"({contract.MEMORY_CKPT_BYTES}: checkpoint.memory.memoryShare of the worker's memory)")
    lacking = max(0, need - held_bytes)
    share = free_bytes // max(1, sharing)
    if lacking > share:
        return f"two copies of this rank's state ({_mib(need)}) need {_mib(lacking)} more than it holds, and " \
               f"its share of the free space there is {_mib(share)}"
    return None


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
    """Processes that write into the same directory's file system (LOCAL_WORLD_SIZE)."""

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
            sharing=number(contract.LOCAL_WORLD_SIZE) or 1,
        )


# --------------------------------------------------------------------------- the engine's local state


def _local(value: Any) -> Any:
    """A state dict with every DTensor replaced by this rank's local tensor, every tensor on the CPU, and
    no view larger than itself (torch.save writes a view's whole storage)."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    if isinstance(value, torch.Tensor):
        t = value.to_local() if hasattr(value, "to_local") else value
        t = t.detach()
        if t.device.type != "cpu":
            return t.cpu()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
            return t.clone()
        return t
    return value


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


def engine_state(engine: LocalState) -> dict[str, Any]:
    """This rank's own part of the engine's state, collective-free."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415

    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    state: dict[str, Any] = {"model": _local(model_sd), "optim": _local(optim_sd),
                             "scheduler": engine.scheduler.state_dict()}
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
    """This rank's state in bytes before any is saved: its parameters (shards), AdamW's two states of each,
    PowerSGD's error feedback (a gradient's size), and some slack."""
    params = 0
    for p in engine.model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        params += t.numel() * t.element_size()
    per_param = 1 + OPTIMIZER_STATES_PER_PARAM + (1 if engine.compression is not None else 0)
    return params * per_param + SLACK_BYTES


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
    """This rank's state fits its budget and free space (the gang keeps the tier only where all fit)."""


class MemoryTier:
    """One rank's memory tier (collective-free). Built only for strategies ddp and fsdp."""

    def __init__(self, settings: TierSettings, engine: LocalState, rank: int, world_size: int, strategy: str):
        self.settings = settings
        self.engine = engine
        self.rank = rank
        self.world_size = world_size
        self.strategy = strategy
        self.root = rank_dir(settings.directory, rank)
        self.active = True
        self.last_bytes: int | None = None
        self.skip_warned = False

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
        return cls(settings, local, rank, world_size, spec.strategy)

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
        try:
            free = free_bytes(self.settings.directory)
        except OSError as exc:
            log.warning("checkpoint.memory is off: %s: %s; restarts resume from the durable tier",
                        self.settings.directory, exc)
            return Offer(tuple(s for s, _ in held), False)
        held_bytes = sum(tree_bytes(p) for _, p in held)
        why = does_not_fit(estimate_bytes(self.engine), self.settings.budget_bytes, free, held_bytes,
                           self.settings.sharing)
        if why:
            log.warning("checkpoint.memory is off: %s; restarts resume from the durable tier", why)
        return Offer(tuple(s for s, _ in held), why is None)

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
        """The gang keeps no tier this generation: nothing of it stays in memory."""
        self.active = False
        self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # -- saving

    def due(self, step: int, *, final: bool) -> bool:
        return self.active and not final and step % self.settings.every_steps == 0

    def maybe_save(self, state: TrainerState, *, final: bool) -> Path | None:
        """Write this rank's part of ``state.step`` when due (no collective); the committed directory, or None."""
        if not self.due(state.step, final=final):
            return None
        hangs.write_beat(state.step, hangs.CHECKPOINT, force=True)
        try:
            return self._save(state)
        finally:
            hangs.write_beat(state.step, force=True)  # judged as training again

    def _save(self, state: TrainerState) -> Path | None:
        expected = self.last_bytes or estimate_bytes(self.engine)
        try:
            free = free_bytes(self.settings.directory)
        except OSError:
            free = 0
        if expected > free // max(1, self.settings.sharing):
            if not self.skip_warned:
                log.warning("checkpoint.memory: step %d not kept: %s free in %s, this rank's state takes %s "
                            "(said once; later steps are skipped alike while it stays full)", state.step,
                            _mib(free), self.settings.directory, _mib(expected))
                self.skip_warned = True
            return None
        t0 = time.perf_counter()
        path = self.root / checkpoint_dirname(state.step)
        try:
            written = self._write(path, state)
        except OSError as exc:
            log.warning("checkpoint.memory is off: writing %s failed (%s); restarts resume from the durable tier",
                        path, exc)
            self.turn_off()
            return None
        budget = self.settings.budget_bytes
        if budget is not None and 2 * written > budget:
            log.warning("checkpoint.memory is off: this rank's state takes %s, two copies exceed its budget of %s; "
                        "restarts resume from the durable tier", _mib(written), _mib(budget))
            self.turn_off()
            return None
        self.last_bytes = written
        for entry in self.root.glob("step-*"):
            if entry != path:
                shutil.rmtree(entry, ignore_errors=True)
        if self.rank == 0:
            log.info("memory tier step %d kept in %.2fs (%s on this rank)", state.step, time.perf_counter() - t0,
                     _mib(written))
        return path

    def _write(self, path: Path, state: TrainerState) -> int:
        if path.exists():  # a torn write of the same step, by an earlier generation
            shutil.rmtree(path)
        path.mkdir(parents=True, mode=0o700)
        try:
            torch.save({"engine": engine_state(self.engine), "rng": rng_state()}, path / STATE_FILE)
            if self.engine.compression is not None:
                self.engine.compression.save(path)
            atomic_write_text(path / TRAINER_STATE, json.dumps(asdict(state)))
            written = tree_bytes(path)
            marker = {"step": state.step, "rank": self.rank, "worldSize": self.world_size,
                      "strategy": self.strategy, "bytes": written, "time": now_rfc3339()}
            atomic_write_text(path / COMMIT_MARKER, json.dumps(marker) + "\n")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return written

