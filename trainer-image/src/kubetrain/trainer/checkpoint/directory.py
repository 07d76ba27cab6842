"""Checkpoint directories: ``<dir>/step-NNNNNNNN/`` committed by an atomic rename.

Every rank writes its part (the engine's model/optimizer state, its own RNG file) into a directory private to
its gang, ``step-NNNNNNNN.writing-<gang>``; once every rank's part is written (a barrier; for a background
write, background.py) rank 0 writes the trainer state and the ``COMMITTED`` marker into it and renames it to
``step-NNNNNNNN``. The rename never replaces a committed directory, so a gang that runs on beside a newer one
(a node cut off from the API server) can never remove, rewrite or tear a checkpoint the newer gang committed.
A private directory left by a crash is ignored on resume and removed by a later commit.
Ephemeral checkpoints (a directory per pod, nobody else writing there) are written in place.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kubetrain.core.contract import format_time
from kubetrain.core.progress import COMMIT_MARKER, atomic_write_text, checkpoint_dirname, complete_checkpoints
from kubetrain.trainer.checkpoint.fence import Fence
from kubetrain.trainer.checkpoint.safe_load import safe_load
from kubetrain.trainer.config import ConfigError

if TYPE_CHECKING:
    from kubetrain.trainer.checkpoint.savable import Savable

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer.json"
BEST_EVAL = "best-eval.json"
"""In the checkpoint directory: {step, loss, path} of the checkpoint taken at the lowest eval loss so far."""
VISIBLE_WITHIN_SECONDS = 30.0
"""How long rank 0 waits for the other ranks' files to show up (a shared file system's caches)."""


@dataclass
class TrainerState:
    """What the loop needs besides the engine's tensors; kept across restarts."""

    step: int = 0
    samples_seen: int = 0
    """Data position: samples consumed by all ranks (the sampler itself is a pure function of step)."""
    world_size: int = 0
    strategy: str = ""
    initial_loss: float | None = None
    checkpoints: list[int] = field(default_factory=list)
    eval_loss: float | None = None
    eval_step: int | None = None
    """The newest evaluation: its loss and step."""
    best_eval: dict[str, Any] | None = None
    """{step, loss} of the checkpoint taken at the evaluation with the lowest loss so far (kept by pruning)."""

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TrainerState:
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)


def now_rfc3339() -> str:
    return format_time(datetime.now(UTC), micros=True)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(root: Path, engine: Savable, state: TrainerState, keep: int, shared: bool = True,
                    before_commit: Callable[[], None] | None = None, writing: str | None = "writing") -> Path:
    """Collective: every rank calls it. Returns the committed directory. `shared`: the directory is
    one for all workers, so rank 0 requires every rank's part in it before committing. `before_commit`: rank 0
    calls it just before it commits (the generation fence's check, which raises to stop the commit). `writing`:
    the suffix of the gang's private directory (writing_name), None to write in place (ephemeral)."""
    path = prepare_dir(root, state.step, writing)
    engine.save(path)
    save_rng(path)
    dist.barrier()
    if dist.get_rank() == 0:
        commit_checkpoint(root, path, state, keep, shared, before_commit)
    return root / checkpoint_dirname(state.step)


def writing_name(gang: Fence | None) -> str:
    """The suffix of a gang's private step directories: one per run and generation (two gangs never share one)."""
    if gang is None:
        return "writing"
    return f"writing-g{gang.generation}-{hashlib.sha256(gang.run.encode()).hexdigest()[:10]}"


def dir_written(root: Path, step: int, writing: str | None) -> Path:
    """Where a save of `step` is written: ``step-NNNNNNNN.<writing>``, or the step's own with `writing` None."""
    return root / (checkpoint_dirname(step) if writing is None else f"{checkpoint_dirname(step)}.{writing}")


def prepare_dir(root: Path, step: int, writing: str | None = None) -> Path:
    """Collective: the directory this gang writes the step into, created by rank 0 before any rank writes into
    it: ``step-NNNNNNNN.<writing>``, private to the gang, or with `writing` None the step's own (ephemeral
    checkpoints: each pod has a directory of its own, where rank 0 created nothing)."""
    path = dir_written(root, step, writing)
    if dist.get_rank() == 0:
        if path.exists():  # this gang's own torn save of the same step (a failed attempt)
            shutil.rmtree(path)
        path.mkdir(parents=True)
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_rng(path: Path) -> None:
    """This rank's RNG file: the part rank 0 requires before it commits (a synchronous save writes it after
    the engine state; a background one before staging, and commits only once every rank's write finished)."""
    (path / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), path / "rng" / f"rank-{dist.get_rank():05d}.pt")


def commit_checkpoint(root: Path, path: Path, state: TrainerState, keep: int, shared: bool = True,
                      before_commit: Callable[[], None] | None = None) -> Path:
    """Rank 0, once every rank's part of `path` is written: trainer.json and the COMMITTED marker, the rename to
    the step's directory, best-eval.json when this is the best evaluation's checkpoint, then pruning. Returns
    the committed directory. `state`: as of the saved step. `before_commit` (the generation fence's check) runs
    before anything is written, and again right before the marker, after the wait for the parts (up to
    VISIBLE_WITHIN_SECONDS), during which a newer gang may start. A private directory that is not committed
    (refused or failed) is removed: nothing of a stale gang stays behind."""
    check = before_commit if before_commit is not None else _no_check
    try:
        check()
        atomic_write_text(path / TRAINER_STATE, json.dumps(asdict(state), indent=1))
        if shared:
            require_every_part(path, dist.get_world_size())
        check()
        atomic_write_text(path / COMMIT_MARKER, json.dumps(commit_marker(state)) + "\n")
        final = publish(root, path, state.step, check)
    except BaseException:
        if path.name != checkpoint_dirname(state.step):
            shutil.rmtree(path, ignore_errors=True)
        raise
    best = (state.best_eval or {}).get("step")
    if best == state.step:
        atomic_write_text(root / BEST_EVAL, json.dumps({**(state.best_eval or {}), "path": final.name}) + "\n")
    prune(root, keep, best)
    return final


def _no_check() -> None:
    return None


def publish(root: Path, path: Path, step: int, check: Callable[[], None]) -> Path:
    """Rename the complete private directory `path` to the step's own. Never over a committed one: where the step
    is committed already, `check` runs once more (a stale gang stops here) and this gang's copy goes (another
    gang committed the same step first; the first commit stands)."""
    final = root / checkpoint_dirname(step)
    if path == final:
        return final
    try:
        path.rename(final)
        return final
    except OSError as exc:
        if final.is_dir():
            pass
        elif exc.errno in RENAME_REFUSED:
            raise _no_rename(path, final, exc) from exc
        else:
            raise
    if not (final / COMMIT_MARKER).is_file():  # torn, written in place by an earlier version of the trainer
        shutil.rmtree(final)
        path.rename(final)
        return final
    check()
    log.warning("checkpoint step %d was committed by another gang of this run first; keeping that one", step)
    shutil.rmtree(path, ignore_errors=True)
    return final


RENAME_REFUSED = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EPERM})
"""A directory rename's errors that no retry cures: the filesystem does not rename directories (object-store FUSE
mounts: Mountpoint for S3, gcsfuse without --rename-dir-limit on a flat bucket)."""


def _no_rename(path: Path, final: Path, exc: OSError) -> ConfigError:
    return ConfigError(
        "spec.checkpoint",
        f"the filesystem under {final.parent} refused to rename {path.name} to {final.name} "
        f"({exc.strerror or exc}): saves are committed by renaming a directory. Keep checkpoints on a filesystem "
        "that renames directories (NFS, EFS, Filestore, Lustre, a local disk; gcsfuse with --rename-dir-limit or "
        "a bucket with hierarchical namespace), or in object storage with checkpoint.uri",
    )


def commit_marker(state: TrainerState) -> dict[str, Any]:
    """What COMMITTED holds (its presence is what counts)."""
    return {"step": state.step, "worldSize": state.world_size, "strategy": state.strategy, "time": now_rfc3339()}


def missing_parts(path: Path, world_size: int) -> list[int]:
    """Ranks whose RNG file (written after the rank's engine state) rank 0 cannot see in `path`."""
    return [r for r in range(world_size) if not (path / "rng" / f"rank-{r:05d}.pt").is_file()]


def require_every_part(path: Path, world_size: int, within: float = VISIBLE_WITHIN_SECONDS) -> None:
    """A checkpoint is complete only with every rank's part: never commit one whose parts sit in
    directories private to each worker (a per-pod volume), which could not be resumed from."""
    deadline = time.monotonic() + within
    while missing := missing_parts(path, world_size):
        if time.monotonic() >= deadline:
            raise ConfigError(
                "spec.checkpoint",
                f"{path} holds no part of rank(s) {missing[:8]} after every rank saved: the checkpoint directory "
                "is not shared by all workers. Use a claim every worker mounts (the default, or claimName with "
                "ReadWriteMany for several workers); checkpoint.dir must lie on it",
            )
        time.sleep(0.5)


def prune(root: Path, keep: int, best_eval: int | None = None) -> None:
    """Delete committed checkpoints beyond the newest ``keep`` (never the best-eval one), and torn ones
    older than the newest."""
    done = complete_checkpoints(root)
    for step, old in done[:-keep]:
        if step != best_eval:
            shutil.rmtree(old, ignore_errors=True)
    if done:
        newest = done[-1][0]
        committed = {p.name for _, p in done}
        for entry in root.glob("step-*"):
            if entry.is_dir() and entry.name not in committed and entry.name < checkpoint_dirname(newest):
                shutil.rmtree(entry, ignore_errors=True)


def load_checkpoint(path: Path, engine: Savable) -> TrainerState:
    """Collective: restore the engine, this rank's RNG and the trainer state from a committed directory."""
    state = TrainerState.from_json(json.loads((path / TRAINER_STATE).read_text()))
    engine.load(path, state.world_size)
    rng_file = path / "rng" / f"rank-{dist.get_rank():05d}.pt"
    if rng_file.is_file():  # absent when resuming at a larger world size
        set_rng_state(safe_load(rng_file))
    return state
