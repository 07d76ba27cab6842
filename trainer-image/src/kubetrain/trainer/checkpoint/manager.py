"""When the loop checkpoints and where it starts from: the policy over directory.py's format.

:class:`CheckpointManager` resumes at start from the newest state the gang holds (the memory tier's
newest step every rank holds, when it is at least the durable tier's newest committed step, else
that committed checkpoint: :func:`plan_resume`) and, after
every step, decides by itself whether a save is due (every ``everySteps``, the last step, a
stop requested by a signal when ``onSigterm``). Each commit is timed, counted and reported.

With ``asyncSave`` (ddp, fsdp) a due save stages the state and returns; the write runs in the background
and is committed after a later step's all-reduce says every rank's write finished (:meth:`write_done`,
:meth:`after_step`; background.py). The last step's save and a save on a stop wait for their write.

With ``checkpoint.uri`` the durable tier is a bucket (object_store.py): each rank stages its part in a
directory of its own under ``root`` and uploads it (after the background write, or before the synchronous
save's commit), rank 0 commits in the bucket, and a resume downloads the committed step once per worker.
Errors there are shared in the collective each such point already has, so every rank fails alike.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from kubetrain.core import contract
from kubetrain.core.api import CheckpointSpec, ResumeTier
from kubetrain.core.progress import checkpoint_dirname, latest_checkpoint
from kubetrain.trainer.checkpoint.background import (
    CheckpointWriteError,
    DcpWriter,
    InFlight,
    commit_due,
    save_waits_for_its_write,
    writes_in_background,
    writes_running,
)
from kubetrain.trainer.checkpoint.budget import GangPlan, PodMemory, RankNeed, own_bytes, plan_gang
from kubetrain.trainer.checkpoint.directory import (
    TrainerState,
    commit_checkpoint,
    dir_written,
    load_checkpoint,
    prepare_dir,
    save_checkpoint,
    save_rng,
    writing_name,
)
from kubetrain.trainer.checkpoint.fence import Fence, GenerationFence, StaleGeneration, on_directory
from kubetrain.trainer.checkpoint.memory import MemoryTier, Offer, choose_tier, common_step, estimate_bytes
from kubetrain.trainer.checkpoint.object_store import (
    FIELD,
    Bucket,
    drop_staged,
    fresh_step_dir,
    restore_dir,
    staging_dir,
)
from kubetrain.trainer.checkpoint.savable import Savable
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.observe.memory import host_resident_bytes
from kubetrain.trainer.observe.metrics import Metrics

log = logging.getLogger("kubetrain.trainer")

DEFAULT_WAIT_SECONDS = 600.0
"""How long a save waits for the previous background write when no timeout is given (torch's default)."""


class CheckpointReporter(Protocol):
    """Where resumes and commits are reported (the loop's progress Reporter)."""

    def resumed(self, step: int, tier: ResumeTier) -> None: ...

    def checkpoint(self, state: TrainerState, path: Path | str, seconds: float) -> None: ...

    def memory_notices(self, notices: list[str]) -> None: ...


def save_due(policy: CheckpointSpec, step: int, *, final: bool, stopping: bool) -> bool:
    """Whether the step just finished ends with a checkpoint. Every rank must get the same answer:
    ``stopping`` is the gang's agreed stop, not this process's own signal."""
    return final or step % policy.every_steps == 0 or (stopping and policy.on_sigterm)


@dataclass(frozen=True)
class ResumePlan:
    """What the gang resumes from, the same on every rank (computed from the same gathered offers)."""

    tier: ResumeTier | None
    """None: nothing to resume from (a fresh start)."""
    step: int
    durable_path: str | None
    """The durable checkpoint to load (tier durable)."""
    keep_memory: bool
    """The gang keeps its memory tier this generation: it has one, and every rank's state fits it."""
    unfit_ranks: tuple[int, ...] = ()


def plan_resume(offers: list[Offer | None], durable: tuple[int, str] | None) -> ResumePlan:
    """The gang's resume from every rank's memory-tier offer (None: the tier is off) and rank 0's newest
    committed durable checkpoint (step, path)."""
    memory_step = common_step([o.steps if o is not None else None for o in offers])
    durable_step = durable[0] if durable is not None else None
    tier = choose_tier(memory_step, durable_step)
    unfit = tuple(r for r, o in enumerate(offers) if o is not None and not o.fits)
    keep = bool(offers) and all(o is not None for o in offers) and not unfit
    if tier == "memory":
        return ResumePlan("memory", memory_step or 0, None, keep, unfit)
    if tier == "durable" and durable is not None:
        return ResumePlan("durable", durable[0], durable[1], keep, unfit)
    return ResumePlan(None, 0, None, keep, unfit)


@dataclass
class CheckpointManager:
    """Collective: every rank holds one and calls :meth:`resume` and :meth:`maybe_save` at the same points."""

    root: Path
    policy: CheckpointSpec
    engine: Savable
    metrics: Metrics
    reporter: CheckpointReporter
    memory: MemoryTier | None = None
    """checkpoint.memory on this rank (None: off)."""
    timeout: timedelta | None = None
    """The gang's collective timeout: how long background writes' collectives, and a save waiting for the
    previous write, wait for the other ranks (None: torch's default)."""
    in_flight: InFlight | None = field(default=None, init=False)
    """The save whose write runs in the background (at most one)."""
    writer: DcpWriter | None = field(default=None, init=False)
    """The background writes' process group and staging buffers (None: this job saves synchronously)."""
    store: Bucket | None = field(default=None, init=False)
    """checkpoint.uri (None: the durable tier is the directory ``root``). With it ``root`` only stages."""
    fence_id: Fence | None = None
    """This gang's run and generation, fenced in the durable tier (None: not fenced)."""
    fence: GenerationFence = field(init=False)

    def __post_init__(self) -> None:
        # Collective (it creates a process group): every rank constructs its manager at the same point, and
        # the group's set-up (a store round trip) is then no part of the first save's stall.
        if writes_in_background(self.policy, self.engine.spec.strategy):
            self.writer = DcpWriter(self.engine.device, self.timeout)
        if self.policy.uri:
            self.store = Bucket.open(self.policy.uri, self.engine.spec.s3)
        self.fence = self.store.fence(self.fence_id) if self.store is not None else on_directory(self.root,
                                                                                                  self.fence_id)

    @property
    def staging(self) -> Path:
        """Where this rank writes a save: with checkpoint.uri a directory of its own, else the shared ``root``."""
        return staging_dir(self.root, dist.get_rank()) if self.store is not None else self.root

    def resume(self, state: TrainerState) -> TrainerState:
        """Load the newest state the gang holds into the engine (and this rank's RNG); the state to go on
        from. ``state`` is what the progress file carried over; without a checkpoint it is returned as is.
        One collective picks it: every rank offers the memory-tier steps it holds and its memory figures, rank 0
        the durable tier's newest committed checkpoint, and every rank computes the same plans from what all
        offered: where to resume from, and what the pods' memory holds of background staging and the tier."""
        rank = dist.get_rank()
        durable, error = self._durable_offer() if rank == 0 else (None, None)
        offer = self.memory.offer() if self.memory is not None else None
        mine: dict[str, Any] = {"offer": offer, "durable": durable, "error": error, "need": self._need(offer)}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        _raise_shared([gathered[0]["error"]])  # every rank fails alike, none waits in a collective for rank 0
        plan = plan_resume([g["offer"] for g in gathered], gathered[0]["durable"])
        budget = self._plan_memory([g["need"] for g in gathered])
        saved = self._load(plan) if plan.tier is not None else None
        self._keep_in_memory(plan, budget)
        if saved is None:
            return state
        if saved.world_size != state.world_size:
            log.info("resharding checkpoint from world size %d to %d", saved.world_size, state.world_size)
        return replace(
            state,
            step=saved.step,
            samples_seen=saved.samples_seen,
            initial_loss=saved.initial_loss if saved.initial_loss is not None else state.initial_loss,
            checkpoints=sorted(set(saved.checkpoints) | set(state.checkpoints)),
        )

    def _need(self, offer: Offer | None) -> RankNeed | None:
        """This rank's memory figures for the pod's budget; None where the engine keeps no per-rank state."""
        local = self.engine.local_state()
        if local is None:
            return None
        state = estimate_bytes(local)
        own = own_bytes(host_resident_bytes(), state, state_on_host=self.engine.device.type == "cpu")
        if offer is None:
            return RankNeed(state, own)
        return RankNeed(state, own, offer.held_bytes, offer.free_bytes)

    def _plan_memory(self, needs: list[RankNeed | None]) -> GangPlan | None:
        """What the pods' memory holds: background staging, the memory tier (budget.plan_gang); None where there
        is nothing to plan (DeepSpeed)."""
        if any(n is None for n in needs):
            return None
        return plan_gang(PodMemory.from_env(os.environ), [n for n in needs if n is not None],
                         staging=self.writer is not None, tier=self.memory is not None)

    def _keep_in_memory(self, plan: ResumePlan, budget: GangPlan | None) -> None:
        """Apply the memory plan: synchronous saves where staging does not fit, the tier where it does (with
        this rank's budget); rank 0 says once what does not fit, in its log and its progress record."""
        rank = dist.get_rank()
        if budget is not None and not budget.staging and self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.memory is not None:
            self.memory.keep_only_up_to(plan.step)  # later steps: a lineage this gang abandoned
            budgets = budget.tier_budgets if budget is not None else None
            if not plan.keep_memory or budgets is None:
                self.memory.turn_off()
                if rank == 0 and plan.unfit_ranks:
                    log.warning("checkpoint.memory is off for this generation: rank(s) %s cannot use %s (each "
                                "says why in its log)", list(plan.unfit_ranks), self.memory.settings.directory)
            else:
                self.memory.budget_bytes = budgets[rank]
        if rank == 0 and budget is not None and budget.notices:
            for notice in budget.notices:
                log.warning("%s", notice)
            self.reporter.memory_notices(list(budget.notices))

    def _durable_offer(self) -> tuple[tuple[int, str] | None, tuple[str, str] | None]:
        """Rank 0: the durable tier's newest committed checkpoint (step, path or uri), or the error that stops
        the gang (kind, message). In object storage it first checks access and removes torn steps."""
        if self.store is not None:  # first contact: a missing bucket or refused keys named before the fence's write
            _, error = _shared_call(self.store.check)
            if error is not None:
                return None, error
        _, error = _shared_call(self.fence.claim)
        if error is not None:
            return None, error
        if self.store is None:
            found = latest_checkpoint(self.root)
            return ((found[0], str(found[1])) if found is not None else None), None
        return _shared_call(self.store.resume_point)

    def _load(self, plan: ResumePlan) -> TrainerState:
        t0 = time.perf_counter()
        if plan.tier == "memory" and self.memory is not None:
            saved = self.memory.load(plan.step)
            where = f"the memory tier ({self.memory.settings.directory})"
        elif self.store is not None:
            saved = self._load_from_store(plan.step)
            where = str(plan.durable_path)
        else:
            saved = load_checkpoint(Path(str(plan.durable_path)), self.engine)
            where = str(plan.durable_path)
        seconds = time.perf_counter() - t0
        self.metrics.observe_checkpoint_load(seconds)
        self.reporter.resumed(plan.step, plan.tier or "durable")
        if dist.get_rank() == 0:
            log.info("resumed from %s (step %d) in %.2fs", where, plan.step, seconds)
        return saved

    def _load_from_store(self, step: int) -> TrainerState:
        """Collective: each worker's first process downloads the committed ``step`` once for the worker's
        processes; all load it; the download goes once every process has loaded."""
        local_rank = int(os.environ.get(contract.LOCAL_RANK) or 0)
        root = restore_dir(self.root, int(os.environ.get(contract.NODE_RANK) or 0))
        assert self.store is not None
        store = self.store
        _, error = _shared_call(lambda: store.download(step, root)) if local_rank == 0 else (None, None)
        _agree(error)
        saved = load_checkpoint(root / checkpoint_dirname(step), self.engine)
        dist.barrier()
        if local_rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        return saved

    def due(self, step: int, *, final: bool, stopping: bool) -> bool:
        return save_due(self.policy, step, final=final, stopping=stopping)

    def maybe_save(self, state: TrainerState, *, final: bool, stopping: bool) -> Path | str | None:
        """Save ``state.step`` when a save is due. The directory committed now, or None (not due, or written
        in the background: committed by a later :meth:`after_step`). A write still in flight is waited for
        and committed first (one in flight at most; the wait is part of this save's stall)."""
        if not self.due(state.step, final=final, stopping=stopping):
            return None
        t0 = time.perf_counter()
        state.checkpoints = sorted(set(state.checkpoints) | {state.step})
        evaluated_now = state.eval_step == state.step and state.eval_loss is not None
        if evaluated_now and (state.best_eval is None or state.eval_loss < state.best_eval["loss"]):
            state.best_eval = {"step": state.step, "loss": state.eval_loss}
        self._finish_in_flight()
        _agree(_shared_call(lambda: self.fence.check(what=f"step {state.step}"))[1] if dist.get_rank() == 0 else None)
        try:
            if self.writer is not None and not save_waits_for_its_write(final=final, stopping=stopping):
                self._start(self.writer, state, t0)
                return None
            path = self._save_now(state)
        except Exception as exc:
            self._explain_if_stale(exc, f"step {state.step}", state.step)
            raise
        seconds = time.perf_counter() - t0
        self._committed(state, path, seconds)
        if dist.get_rank() == 0:
            log.info("checkpoint step %d committed in %.3f s: %s", state.step, seconds, path)
        return path

    def _save_now(self, state: TrainerState) -> Path | str:
        """Collective, synchronous: write and commit ``state.step``; where it is committed."""
        if self.store is not None:
            return self._save_to_store(self.store, state)
        # ephemeral checkpoints sit in each pod's own directory: nothing to require of the others
        return save_checkpoint(self.root, self.engine, state, self.policy.keep, shared=not self.policy.ephemeral,
                               before_commit=lambda: self.fence.check(what=f"commit of step {state.step}"),
                               writing=self._writing)

    @property
    def _writing(self) -> str | None:
        """The suffix of this gang's private step directories in ``root``; None: saves are written in place."""
        return None if self.policy.ephemeral or self.store is not None else writing_name(self.fence_id)

    def _explain_if_stale(self, exc: Exception, what: str, step: int) -> None:
        """A write into the durable tier failed: on rank 0 StaleGeneration instead where a newer generation took
        the checkpoints over (its pruning removes what a stale gang was writing, so the write fails first), and
        nothing of this gang's save of ``step`` left beside the newer gang's checkpoints."""
        if dist.get_rank() != 0 or isinstance(exc, StaleGeneration):
            return
        try:
            self.fence.check(what=what)
        except StaleGeneration:
            if self._writing is not None:
                shutil.rmtree(dir_written(self.root, step, self._writing), ignore_errors=True)
            raise

    def _save_to_store(self, store: Bucket, state: TrainerState) -> str:
        """Collective, synchronous: every rank writes its part to its own directory and uploads it; once all
        uploads finished, rank 0 commits in the bucket."""
        path = fresh_step_dir(self.staging, state.step)
        self.engine.save(path)
        save_rng(path)
        _agree(_shared_call(lambda: store.upload(path, state.step))[1])
        if dist.get_rank() == 0:
            self.fence.check(what=f"commit of step {state.step}")
            store.commit(path, state, self.policy.keep, dist.get_world_size())
        drop_staged(self.staging, state.step)
        return store.step_uri(state.step)

    def write_done(self) -> bool:
        """This rank's vote in the step's all-reduce: its in-flight write finished. Raises
        CheckpointWriteError when the write failed (never committed, never dropped silently); on rank 0
        StaleGeneration instead where a newer generation took the checkpoints over (and removed the torn
        directory this write went to)."""
        try:
            return self.in_flight is not None and self.in_flight.finished()
        except CheckpointWriteError as exc:
            if self.in_flight is not None:
                self._explain_if_stale(exc, f"background write of step {self.in_flight.step}", self.in_flight.step)
            raise

    def after_step(self, finished_ranks: int) -> Path | str | None:
        """After the step's all-reduce (``finished_ranks``: the sum of every rank's :meth:`write_done`, the
        same number on every rank): commit the in-flight save once every rank's write finished."""
        if not commit_due(self.in_flight is not None, finished_ranks, dist.get_world_size()):
            return None
        return self._commit_in_flight()

    def close(self) -> None:
        """At exit, however it comes. A write still in flight is never committed here (no rank can know that
        the others finished); it stays a torn directory that resume ignores and the next commit removes."""
        job, self.in_flight = self.in_flight, None
        if job is not None:
            log.warning("checkpoint step %d not committed: exiting with its background write %s (%s)",
                        job.step, job.status(), job.path)
        if self.writer is not None and not writes_running():  # the writer thread reads the staging buffers
            self.writer.close()
        if self.memory is not None:
            self.memory.close()

    def _start(self, writer: DcpWriter, state: TrainerState, t0: float) -> None:
        """Stage this rank's part of ``state.step`` and start writing it; returns once training may go on."""
        if self.store is not None:
            path = fresh_step_dir(self.staging, state.step)
        else:
            path = prepare_dir(self.root, state.step, self._writing)
        # Everything written in the foreground goes first: once the background write runs, a failure here would
        # leave it writing (and creating its directory again) after a stale gang removed what it had begun.
        save_rng(path)
        future = self.engine.save_async(path, writer)
        if self.store is not None:  # "finished" is "written and uploaded"
            future = self.store.upload_after(future, path, state.step)
        now = time.perf_counter()
        self.in_flight = InFlight(state.step, path, copy.deepcopy(state), future, started=now, stall=now - t0)
        if dist.get_rank() == 0:
            log.info("checkpoint step %d staged in %.3f s (writing in the background)", state.step, now - t0)

    def _finish_in_flight(self) -> None:
        """Wait for the in-flight write (at most the gang's timeout), then commit it."""
        if self.in_flight is None:
            return
        self.in_flight.wait(self.timeout.total_seconds() if self.timeout else DEFAULT_WAIT_SECONDS)
        dist.barrier()  # every rank's write finished
        self._commit_in_flight()

    def _commit_in_flight(self) -> Path | str:
        job, self.in_flight = self.in_flight, None
        assert job is not None
        where: Path | str
        if self.store is not None:
            where = self.store.step_uri(job.step)
            if dist.get_rank() == 0:
                self.fence.check(what=f"commit of step {job.step}")
                self.store.commit(job.path, job.state, self.policy.keep, dist.get_world_size())
            drop_staged(self.staging, job.step)
        else:
            where = self.root / checkpoint_dirname(job.step)
            if dist.get_rank() == 0:
                commit_checkpoint(self.root, job.path, job.state, self.policy.keep, shared=not self.policy.ephemeral,
                                  before_commit=lambda: self.fence.check(what=f"commit of step {job.step}"))
        if dist.get_rank() == 0:
            log.info("checkpoint step %d committed: write took %.2f s", job.step, job.write_seconds())
        self._committed(job.state, where, job.stall)
        return where

    def _committed(self, state: TrainerState, path: Path | str, stall: float) -> None:
        """A commit's metrics and report: ``stall`` is how long training stopped for the save."""
        self.metrics.observe_checkpoint_save(stall)
        self.reporter.checkpoint(state, path, stall)


def _shared_call(fn: Callable[[], Any]) -> tuple[Any, tuple[str, str] | None]:
    """fn()'s result, or its error as (kind, message) to share with the other ranks (see _raise_shared)."""
    try:
        return fn(), None
    except ConfigError as exc:
        return None, ("config", exc.message)
    except Exception as exc:  # noqa: BLE001 - shared, then raised on every rank
        return None, ("error", f"{type(exc).__name__}: {exc}")


def _agree(error: tuple[str, str] | None) -> None:
    """Collective: every rank learns every rank's error and raises the first, so none waits for a failed one."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    _raise_shared(gathered)


def _raise_shared(errors: list[tuple[str, str] | None]) -> None:
    for error in errors:
        if error is None:
            continue
        kind, message = error
        if kind == "config":
            raise ConfigError(FIELD, message)
        raise RuntimeError(f"{FIELD}: {message}")
