"""When the loop checkpoints and where it starts from: the policy over checkpoint.py's directory format.

:class:`CheckpointManager` resumes from the newest committed checkpoint at start and, after
every step, decides by itself whether a save is due (every ``everySteps``, the last step, a
stop requested by a signal when ``onSigterm``). Each commit is timed, counted and reported.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from kubetrain.core.api import CheckpointSpec
from kubetrain.core.progress import latest_checkpoint
from kubetrain.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from kubetrain.trainer.engines import Engine
from kubetrain.trainer.metrics import Metrics

log = logging.getLogger("kubetrain.trainer")


class CheckpointReporter(Protocol):
    """Where resumes and commits are reported (the loop's progress Reporter)."""

    def resumed(self, step: int) -> None: ...

    def checkpoint(self, state: TrainerState, path: Path, seconds: float) -> None: ...


def save_due(policy: CheckpointSpec, step: int, *, final: bool, stopping: bool) -> bool:
    """Whether the step just finished ends with a checkpoint. Every rank must get the same answer:
    ``stopping`` is the gang's agreed stop, not this process's own signal."""
    return final or step % policy.every_steps == 0 or (stopping and policy.on_sigterm)


@dataclass
class CheckpointManager:
    """Collective: every rank holds one and calls :meth:`resume` and :meth:`maybe_save` at the same points."""

    root: Path
    policy: CheckpointSpec
    engine: Engine
    metrics: Metrics
    reporter: CheckpointReporter

    def resume(self, state: TrainerState) -> TrainerState:
        """Load the newest committed checkpoint into the engine (and this rank's RNG); the state to go on
        from. ``state`` is what the progress file carried over; without a checkpoint it is returned as is."""
        # Rank 0 picks the checkpoint so that every rank loads the same one.
        found = [latest_checkpoint(self.root) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return state
        step, path = found[0]
        t0 = time.perf_counter()
        saved = load_checkpoint(Path(path), self.engine)
        seconds = time.perf_counter() - t0
        self.metrics.observe_checkpoint_load(seconds)
        if saved.world_size != state.world_size:
            log.info("resharding checkpoint from world size %d to %d", saved.world_size, state.world_size)
        self.reporter.resumed(step)
        if dist.get_rank() == 0:
            log.info("resumed from %s (step %d) in %.2fs", path, step, seconds)
        return replace(
            state,
            step=saved.step,
            samples_seen=saved.samples_seen,
            initial_loss=saved.initial_loss if saved.initial_loss is not None else state.initial_loss,
            checkpoints=sorted(set(saved.checkpoints) | set(state.checkpoints)),
        )

    def due(self, step: int, *, final: bool, stopping: bool) -> bool:
        return save_due(self.policy, step, final=final, stopping=stopping)

    def maybe_save(self, state: TrainerState, *, final: bool, stopping: bool) -> Path | None:
        """Save and commit ``state.step`` when a save is due; the committed directory, or None."""
        if not self.due(state.step, final=final, stopping=stopping):
            return None
        t0 = time.perf_counter()
        state.checkpoints = sorted(set(state.checkpoints) | {state.step})
        evaluated_now = state.eval_step == state.step and state.eval_loss is not None
        if evaluated_now and (state.best_eval is None or state.eval_loss < state.best_eval["loss"]):
            state.best_eval = {"step": state.step, "loss": state.eval_loss}
        # Ephemeral checkpoints sit in each pod's own directory: nothing to require of the others.
        path = save_checkpoint(self.root, self.engine, state, self.policy.keep, shared=not self.policy.ephemeral)
        seconds = time.perf_counter() - t0
        self.metrics.observe_checkpoint_save(seconds)
        self.reporter.checkpoint(state, path, seconds)
        if dist.get_rank() == 0:
            log.info("checkpoint step %d committed in %.2fs: %s", state.step, seconds, path)
        return path
