"""A Hugging Face Trainer script as a kubetrain custom command, reporting and restarting like the built-in trainer.

    from kubetrain.integrations.transformers import KubetrainCallback, resume_checkpoint

    args = TrainingArguments(output_dir=os.environ["KUBETRAIN_CHECKPOINT_DIR"], logging_steps=1, ...)
    trainer = Trainer(model=model, args=args, ..., callbacks=[KubetrainCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.output_dir))

The callback, on every rank:
- writes a heartbeat each step (kubetrain.core.hangs: `start`, `train`, `eval` before an evaluation,
  `checkpoint` before a save), so hang detection judges the script with the built-in trainer's limits;
- commits each `checkpoint-N` the Trainer saves: after a barrier (every rank has written its part) the
  process that saves (args.should_save: rank 0, or each node's first with save_on_each_node) writes
  COMMIT_MARKER into it, atomically. A folder without it is a save cut off and never resumed from;
- turns SIGTERM and SIGINT into "save at the next step boundary and exit 143": the flag travels in one
  all-reduce per step, so all ranks stop at the same step (a signal on one rank is enough);
- honours the KUBETRAIN_FAIL_AT drill (`kubetrain run --fail-at R:S`): rank R exits 137 after step S in
  generation 0;
- in a gloo gang (CPU), once training ended, lets the process leave at exit without the interpreter's
  teardown (kubetrain.integrations.leave): torch's gloo can abort there, which would fail a rank that finished;
and on rank 0 reports step, loss, eval loss, learning rate and each committed checkpoint through
kubetrain.trainer.observe.progress (progress.json for `kubetrain run`, the pod annotation for the operator):
status.currentStep, loss, lastCheckpoint, resumedFromStep and goodput follow. The loss is the Trainer's
logged one (the mean over ranks since the previous log): set logging_steps small.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from kubetrain.core import contract, hangs
from kubetrain.core.progress import (
    COMMIT_MARKER,
    CheckpointRecord,
    Progress,
    atomic_write_text,
    committed_hf_checkpoints,
)
from kubetrain.integrations.leave import leave_at_exit, register_leave
from kubetrain.trainer.observe.progress import make_progress, report_progress

__all__ = ["KubetrainCallback", "commit_checkpoint", "progress_fields", "refuse_object_store", "resume_checkpoint"]

log = logging.getLogger("kubetrain.integrations.transformers")

SIGTERM_EXIT_CODE = contract.SIGTERM_EXIT_CODE
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_LOG_FIELDS = {"loss": "loss", "eval_loss": "eval_loss", "learning_rate": "learning_rate"}
"""The Trainer's log keys -> Progress fields."""


def commit_checkpoint(path: Path, step: int, world_size: int) -> None:
    """Mark a `checkpoint-N` folder complete: written last, atomically, once every rank's part is there."""
    marker = {"step": step, "worldSize": world_size, "format": "transformers", "time": _now()}
    atomic_write_text(Path(path) / COMMIT_MARKER, json.dumps(marker) + "\n")


def resume_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest committed `checkpoint-N` in output_dir, for `trainer.train(resume_from_checkpoint=...)`;
    None for a fresh start. Folders the callback did not commit (a save cut off by a kill) are skipped, where
    transformers' get_last_checkpoint would take the newest folder whatever its state. Rank 0 reports the step
    to the job at once (status.resumedFromStep)."""
    done = committed_hf_checkpoints(Path(output_dir))
    if not done:
        return None
    step, path = done[-1]
    if _rank() == 0:
        print(f"kubetrain: resuming from {path} (step {step})", file=sys.stderr, flush=True)
        report_progress(progress=make_progress(step).model_copy(update={"resumed_from": step,
                                                                         "resumed_tier": "durable"}))
    return str(path)


def progress_fields(logs: Mapping[str, Any]) -> dict[str, float]:
    """The Progress fields one Trainer log carries (training logs: loss, learning_rate; evaluations: eval_loss)."""
    return {field: float(logs[key]) for key, field in _LOG_FIELDS.items()
            if isinstance(logs.get(key), int | float) and not isinstance(logs.get(key), bool)}


def parse_fail_at(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """KUBETRAIN_FAIL_AT=RANK:STEP in generation 0, else None (the drill fires once)."""
    raw = environ.get(contract.FAIL_AT)
    if not raw or environ.get(contract.RESTART_GENERATION, "0") != "0":
        return None
    rank, _, step = raw.partition(":")
    try:
        return int(rank), int(step)
    except ValueError:
        raise ValueError(f"{contract.FAIL_AT} must be RANK:STEP, got {raw!r}") from None


def _rank() -> int:
    raw = os.environ.get(contract.RANK, "0")
    return int(raw) if raw.isdigit() else 0


def _now() -> str:
    return contract.format_time(datetime.now(UTC))


def _tokens_seen(state: TrainerState) -> int:
    """The gang's input tokens so far; 0 unless TrainingArguments(include_num_input_tokens_seen=...) counts them."""
    return int(getattr(state, "num_input_tokens_seen", 0) or 0)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def refuse_object_store(env: Mapping[str, str]) -> None:
    """Exit 2 naming checkpoint.uri where the job keeps its checkpoints in an object store: the Trainer saves to
    $KUBETRAIN_CHECKPOINT_DIR, which is then the pod's own scratch directory, and every checkpoint would go
    with the pod. The job fails at once with the message instead of training without a checkpoint that lasts."""
    uri = env.get(contract.CHECKPOINT_URI)
    if not uri:
        return
    from kubetrain.trainer.config import ConfigError, config_error  # noqa: PLC0415

    raise SystemExit(config_error(ConfigError(
        "checkpoint.uri", f"{uri}: a Hugging Face Trainer script saves to KUBETRAIN_CHECKPOINT_DIR, which with "
        "checkpoint.uri is the pod's scratch directory and goes with the pod: keep its checkpoints on a volume "
        "(checkpoint.claimName, a ReadWriteMany claim shared by the workers)")))


class KubetrainCallback(TrainerCallback):
    """Progress, heartbeats, committed checkpoints, SIGTERM -> checkpoint + exit 143 (see the module)."""

    def __init__(self, *, handle_signals: bool = True) -> None:
        refuse_object_store(os.environ)
        self.handle_signals = handle_signals
        self.fail_at = parse_fail_at(os.environ)
        self.signalled = False
        """A stop signal arrived on this rank (set by the handler, read at the next step boundary)."""
        self.stopping = False
        """The gang agreed to stop: the save at this step is the last, then exit 143."""
        self.record = Progress()
        self._previous: dict[int, Any] = {}
        self._started = (0.0, 0, 0)
        """(monotonic time, step, tokens seen) when this generation's training began: the rates' origin."""
        register_leave()

    # ------------------------------------------------------------------ hooks

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self.handle_signals:
            self._install_handlers()
        step = state.global_step
        hangs.write_beat(step, hangs.START, force=True)
        self._started = (time.monotonic(), step, _tokens_seen(state))
        losses = [e["loss"] for e in state.log_history if "loss" in e]
        done = [s for s, _ in committed_hf_checkpoints(Path(str(args.output_dir))) if s <= step]
        self.record = make_progress(step, max_steps=state.max_steps).model_copy(update={
            "initial_loss": losses[0] if losses else None,
            "resumed_from": step or None,  # the Trainer loaded its state before this hook
            "resumed_tier": "durable" if step else None,
            "checkpoints": done,
        })
        self._report(state, force=True)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        step = state.global_step
        if self.fail_at is not None and self.fail_at == (_rank(), step):
            print(f"kubetrain: {contract.FAIL_AT}: rank {_rank()} exits after step {step}", file=sys.stderr, flush=True)
            os._exit(contract.FAIL_AT_EXIT_CODE)
        if self._agree_to_stop(args) and step < state.max_steps and not self.stopping:
            self.stopping = True
            control.should_save = control.should_training_stop = control.should_log = True
            if state.is_world_process_zero:
                print(f"kubetrain: stop signal: saving at step {step}, then exit {SIGTERM_EXIT_CODE}",
                      file=sys.stderr, flush=True)
        phase = hangs.EVAL if control.should_evaluate else hangs.CHECKPOINT if control.should_save else hangs.TRAIN
        hangs.write_beat(step, phase)
        self._report(state, force=step == self._started[1] + 1)  # the first step at once, as the built-in trainer

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        fields = progress_fields(logs or {})
        if self.record.initial_loss is None and "loss" in fields:
            fields["initial_loss"] = fields["loss"]
        self.record = self.record.model_copy(update=fields)
        self._report(state)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        hangs.write_beat(state.global_step, hangs.CHECKPOINT if control.should_save else hangs.TRAIN)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        step = state.global_step
        path = Path(str(args.output_dir)) / f"checkpoint-{step}"
        if _distributed():
            dist.barrier()  # every rank returned from its part of the save
        if args.should_save and path.is_dir():
            commit_checkpoint(path, step, args.world_size)
        hangs.write_beat(step, hangs.TRAIN)
        if state.is_world_process_zero and path.is_dir():
            ck = CheckpointRecord(step=step, path=str(path), time=_now())
            done = sorted({*self.record.checkpoints, step})
            self.record = self.record.model_copy(update={"last_checkpoint": ck, "checkpoints": done})
            self._report(state, force=True)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._restore_handlers()
        finished = not self.stopping and state.global_step >= state.max_steps
        self.record = self.record.model_copy(update={"finished": finished})
        self._report(state, force=True)
        if _distributed() and dist.get_backend() == "gloo":
            leave_at_exit(SIGTERM_EXIT_CODE if self.stopping else 0)
        if self.stopping:
            print(f"kubetrain: stopped at step {state.global_step} after its checkpoint; exit {SIGTERM_EXIT_CODE}",
                  file=sys.stderr, flush=True)
            sys.exit(SIGTERM_EXIT_CODE)  # SystemExit: atexit handlers still send the last progress record

    # ------------------------------------------------------------------ parts

    def _report(self, state: TrainerState, force: bool = False) -> None:
        """Rank 0's record as of this step (throttled by report_progress unless forced)."""
        if not state.is_world_process_zero:
            return
        t0, step0, tokens0 = self._started
        steps, seconds = state.global_step - step0, time.monotonic() - t0
        update: dict[str, Any] = {"step": state.global_step, "max_steps": state.max_steps, "time": _now()}
        if steps > 0 and seconds > 0:  # this generation's means, as the built-in trainer reports them
            update["step_seconds"] = seconds / steps
            update["tokens_per_second"] = (_tokens_seen(state) - tokens0) / seconds
        self.record = self.record.model_copy(update=update)
        report_progress(progress=self.record, force=force)

    def _agree_to_stop(self, args: TrainingArguments) -> bool:
        """Whether any rank was signalled: one small all-reduce per step, so all ranks stop at the same step."""
        if not self.handle_signals:
            return False
        if not _distributed():
            return self.signalled
        flag = torch.tensor([1.0 if self.signalled else 0.0], device=args.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def _install_handlers(self) -> None:
        """From the first step on a stop signal only sets a flag; before it (nothing to save) it kills at once."""
        if self._previous:
            return
        try:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread: signals cannot be handled here
            log.warning("kubetrain: trainer.train() is not on the main thread; SIGTERM is not turned into a checkpoint")

    def _restore_handlers(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True
