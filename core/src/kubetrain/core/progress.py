"""Rank 0's progress record and the checkpoint directory layout (no torch here).

The trainer writes `progress.json` atomically after every optimizer step (rate
limited) and after every checkpoint; the local backend and the operator read it
for status, summaries and hang detection. Checkpoints live in
`<checkpoint dir>/step-<NNNNNNNN>/` and count only once `COMMITTED` exists in
them; the marker is written last, atomically, by rank 0 after every rank saved.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field

from kubetrain.core.api import Fetch, MemoryReport, Preflight, _Model

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_HF_DIR = re.compile(r"^checkpoint-(\d+)$")
"""A Hugging Face Trainer checkpoint (transformers' PREFIX_CHECKPOINT_DIR); kubetrain.integrations.transformers
commits it with the same marker once every rank has written it."""


class CheckpointRecord(_Model):
    step: int
    path: str
    time: str
    """RFC 3339 UTC."""
    seconds: float = 0.0
    """How long the save took."""


class Progress(_Model):
    """What rank 0 reports. Field names are camelCase in the file.

    Unknown fields are ignored, not refused: the trainer image and the operator are deployed apart, and
    a record from a newer trainer must still count as progress (hang detection reads it)."""

    # Merged over _Model's (camelCase, ...). A diverged loss (NaN, inf) is written as JSON's NaN/Infinity
    # and read back, so that readers see the divergence instead of refusing the whole record.
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="constants")

    job: str = ""
    generation: int = 0
    step: int = 0
    max_steps: int = 0
    loss: float | None = Field(None, allow_inf_nan=True)
    initial_loss: float | None = None
    """Loss of step 1 of the whole run (kept across restarts)."""
    tokens_per_second: float = 0.0
    """Mean over this generation's steps."""
    step_seconds: float | None = None
    """Mean seconds per step over this generation's steps."""
    mfu: float | None = None
    """Model FLOPs utilization (0-1) over this generation's steps, where the device's peak is known."""
    eval_loss: float | None = Field(None, allow_inf_nan=True)
    """Loss on the held-out text at the newest evaluation (spec.evalEverySteps)."""
    best_eval_step: int | None = None
    """Step of the checkpoint taken at the lowest eval loss so far (best-eval.json in the checkpoint directory)."""
    export: str | None = None
    """Where rank 0 wrote the exported model (spec.export): a directory, or an s3:// URI."""
    world_size: int = 0
    resumed_from: int | None = None
    """Step of the checkpoint this generation resumed from."""
    resumed_tier: Literal["memory", "durable"] | None = None
    """The tier that checkpoint came from (api.ResumeTier)."""
    last_checkpoint: CheckpointRecord | None = None
    checkpoints: list[int] = Field(default_factory=list)
    """Steps of every checkpoint committed in this run (all generations)."""
    time: str = ""
    """When this record was written (RFC 3339 UTC)."""
    finished: bool = False
    """True once maxSteps is reached and the final checkpoint is committed."""
    learning_rate: float | None = None
    """The learning rate at the newest logged step, where the trainer reports it (the Hugging Face callback)."""
    network_transport: str | None = None
    """The network transport NCCL chose (contract.TRANSPORT_*: IB, OFI, GPUDirectTCPX, FasTrak, Socket,
    P2P/SHM) or gloo; None: not known (not probed, or an older trainer)."""
    fetch: Fetch | None = None
    """The fetch of model.hfUri / data.tokenizerUri before training (kubetrain.trainer.data.fetch), as it goes."""
    preflight: Preflight | None = None
    """This generation's preflight (kubetrain.trainer.preflight): every rank's figures, gathered by rank 0."""
    memory: MemoryReport | None = None
    """This generation's peak memory per rank, gathered by rank 0 (kubetrain.trainer.observe.memory), and what the
    pods' memory could not hold of its checkpoints (kubetrain.trainer.checkpoint.budget)."""


def atomic_write_text(path: Path, text: str) -> None:
    """Write a whole file or nothing: temp file in the same directory, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_progress(output_dir: Path, progress: Progress) -> None:
    atomic_write_text(Path(output_dir) / "progress.json", json.dumps(progress.dump(), indent=1))


def read_progress(output_dir: Path) -> Progress | None:
    path = Path(output_dir) / "progress.json"
    try:
        return Progress.model_validate(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, OSError):
        return None  # a torn or foreign file is no progress; the writer replaces it atomically


def checkpoint_dirname(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint, oldest first. Half-written ones are skipped."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and (entry / COMMIT_MARKER).is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def committed_hf_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every Hugging Face `checkpoint-N` directory holding COMMIT_MARKER, oldest first: the ones
    kubetrain.integrations.transformers committed. A folder without it (a save cut off, or a script without the
    callback) is not one kubetrain vouches for."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _HF_DIR.match(entry.name)
        if m and (entry / COMMIT_MARKER).is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def committed_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """Every committed checkpoint a job may have left in its checkpoint directory, oldest first: the built-in
    trainer's `step-N` and a Hugging Face Trainer script's `checkpoint-N`. For the backends (status, resume
    step); the built-in trainer itself loads only its own (complete_checkpoints)."""
    return sorted(complete_checkpoints(checkpoint_dir) + committed_hf_checkpoints(checkpoint_dir))


def latest_checkpoint(checkpoint_dir: Path) -> tuple[int, Path] | None:
    done = complete_checkpoints(checkpoint_dir)
    return done[-1] if done else None
