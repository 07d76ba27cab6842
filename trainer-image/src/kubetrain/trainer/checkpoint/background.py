"""Durable checkpoints written in the background (strategies ddp and fsdp, ``checkpoint.asyncSave``).

A due save copies the engine's state into CPU memory (the stall: training stops only for that), then
``torch.distributed.checkpoint.async_save`` writes it from a background thread while training goes on.
The commit rule is the synchronous save's: rank 0 writes ``COMMITTED`` only once every rank's write has
finished. The ranks learn that without a collective of their own: each adds "my write finished" to the
all-reduce every step already does (loop.mean_loss_and_stop), so when the sum is the world size every
rank takes the same decision from the same number. At most one write is in flight.

This module holds the in-flight save (:class:`InFlight`), the writer that owns the process group and the
staging buffers (:class:`DcpWriter`) and the decisions, as pure functions, that CheckpointManager follows.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kubetrain.core.api import CheckpointSpec
from kubetrain.trainer.checkpoint.directory import TrainerState
from kubetrain.trainer.config import ConfigError

BACKGROUND_STRATEGIES = ("ddp", "fsdp")
"""Engines whose state is a DCP state dict. DeepSpeed 0.19.8's own asynchronous path
(DecoupledCheckpointEngine) is not used: it spawns a writer process per rank that gets the state through
a multiprocessing queue, its FastCheckpointEngine writer needs DeepSpeed's AIO op (libaio, a JIT build)
or pinned CUDA buffers, and its commit only happens inside the next save_checkpoint call, so it gives us
no point to stage at and no "finished" to agree on. DeepSpeed saves synchronously."""

WRITE_DELAY_ENV = "KUBETRAIN_TEST_CKPT_WRITE_DELAY"
"""Test fault: every background write sleeps this many seconds before it writes its files, so that a test
can kill a rank while the write is in flight. Never set in a real job."""

_RUNNING: set[Future[Any]] = set()
"""This process's background writes not finished yet (see :func:`writes_running`)."""


# ---------------------------------------------------------------- pure decisions


def writes_in_background(policy: CheckpointSpec, strategy: str) -> bool:
    """Whether due saves of this job write in the background."""
    return policy.async_save and strategy in BACKGROUND_STRATEGIES


def save_waits_for_its_write(*, final: bool, stopping: bool) -> bool:
    """A save at the last step or on a stop commits before returning: the job ends (or the pod goes away)
    right after it, and it must leave a committed checkpoint."""
    return final or stopping


def commit_due(in_flight: bool, finished_ranks: int, world_size: int) -> bool:
    """After a step's all-reduce: commit the in-flight save when every rank's write has finished.
    ``finished_ranks`` is the all-reduced sum, the same number on every rank, so every rank decides alike."""
    return in_flight and finished_ranks == world_size


def staging_options(device: torch.device) -> Any:
    """Synchronous staging (the copy is complete when async_save returns, so the next optimizer step may
    change the parameters). CUDA: pinned host buffers and non-blocking copies, synchronized before
    returning. CPU: plain copies (a non-blocking copy asserts an accelerator; pinning needs one)."""
    from torch.distributed.checkpoint.staging import StagingOptions  # noqa: PLC0415

    cuda = device.type == "cuda"
    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )


# ---------------------------------------------------------------- the in-flight save


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed or did not finish in time: the rank fails, nothing is committed."""

    def __init__(self, step: int, path: Path, why: str) -> None:
        super().__init__(f"checkpoint step {step}: the background write to {path} {why}; it is not committed "
                         "(resume takes the newest committed checkpoint)")
        self.step = step
        self.path = path


@dataclass
class InFlight:
    """One save whose state is staged and whose write runs in the background."""

    step: int
    path: Path
    state: TrainerState
    """A copy of the trainer state as of the saved step (trainer.json is written from it at commit)."""
    future: Future[Any]
    started: float
    """time.perf_counter() when the write began (after staging)."""
    stall: float
    """Seconds training stopped for this save (waiting for the previous one, staging)."""
    ended: float | None = None
    """time.perf_counter() when the write finished (set by the future's callback)."""

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._ended)

    def _ended(self, _future: Future[Any]) -> None:
        self.ended = time.perf_counter()

    def finished(self) -> bool:
        """Never blocks: True once the write finished without error. A write that raised fails the rank
        (:class:`CheckpointWriteError`): it must never be committed nor silently dropped."""
        if not self.future.done():
            return False
        if isinstance(exc := self.future.exception(), ConfigError):
            raise exc  # the store refused the upload: no restart cures it
        if exc is not None:
            raise CheckpointWriteError(self.step, self.path, f"failed: {exc}") from exc
        return True

    def wait(self, timeout: float) -> None:
        """Block until the write finished; CheckpointWriteError when it failed or takes longer than timeout."""
        try:
            self.future.result(timeout=timeout)
        except FutureTimeout:
            raise CheckpointWriteError(self.step, self.path, f"did not finish within {timeout:.0f} s") from None
        except ConfigError:
            raise
        except Exception as exc:  # whatever the writer raised, named with the step and directory
            raise CheckpointWriteError(self.step, self.path, f"failed: {exc}") from exc

    def status(self) -> str:
        """For a log line: "still running", "failed: ..." or "finished"."""
        if not self.future.done():
            return "still running"
        exc = self.future.exception()
        return f"failed: {str(exc).splitlines()[0]}" if exc is not None else "finished"

    def write_seconds(self) -> float:
        """How long the background write took (until now if it is still running)."""
        return (self.ended or time.perf_counter()) - self.started


def writes_running() -> bool:
    """Whether a background write of this process is still running. Then destroying the process groups
    would wait for the writer's collective (gloo joins its worker threads), so the trainer exits without."""
    return any(not f.done() for f in _RUNNING)


# ---------------------------------------------------------------- the writer


class DcpWriter:
    """The process group and the stager of the background writes, one each for the trainer's lifetime.

    Collective: every rank creates it at the same point (it creates a process group)."""

    def __init__(self, device: torch.device, timeout: timedelta | None = None) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager  # noqa: PLC0415

        # A group of its own, gloo (DCP's async path needs a CPU backend): the writer thread's collectives
        # never interleave with training's on the default group.
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        # One stager, reused: it keeps its CPU (pinned on CUDA) copies for the next save. Never used after
        # close() (torch 2.13 then raises KeyError <class 'type'>).
        self.stager = DefaultStager(staging_options(device))
        self.closed = False

    def write(self, state_dict: dict[str, Any], directory: Path) -> Future[Any]:
        """Stage ``state_dict`` (returns once it is copied), then write it to ``directory`` in the background.

        THREAD, not PROCESS: the process checkpointer starts a daemon per rank that rendezvouses through a
        TCPStore on a random free port of MASTER_ADDR, which a NetworkPolicy that opens only the gang's
        ports blocks."""
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: PLC0415

        if self.closed:
            raise RuntimeError("DcpWriter used after close()")
        future = dcp.async_save(
            state_dict, storage_writer=storage_writer(directory), process_group=self.group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=self.stager,
        )
        if not isinstance(future, Future):  # an AsyncSaveResponse: only with asynchronous staging, never ours
            raise TypeError(f"unexpected async_save result {type(future).__name__}")
        _RUNNING.add(future)
        future.add_done_callback(_RUNNING.discard)
        return future

    def close(self) -> None:
        """Free the staging buffers. Only with no write in flight (the writer thread reads them)."""
        if not self.closed:
            self.closed = True
            self.stager.close()


def storage_writer(directory: Path) -> Any:
    """DCP's file system writer (what dcp.save picks for a path), slowed down under WRITE_DELAY_ENV."""
    from torch.distributed.checkpoint import FileSystemWriter  # noqa: PLC0415

    delay = float(os.environ.get(WRITE_DELAY_ENV) or 0)
    if delay <= 0:
        return FileSystemWriter(directory)

    class SlowWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            time.sleep(delay)
            return super().write_data(plan, planner)

    return SlowWriter(directory)
