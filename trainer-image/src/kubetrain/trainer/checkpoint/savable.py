"""What the checkpoint code needs of an engine: the parts it saves and loads, never the engine itself.

The strategies (parallel/engines.py) satisfy these protocols; the checkpoint modules depend only on them,
so the engines may use the checkpoint formats (safe loading, the legacy reader, background writes)
without an import cycle.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from kubetrain.core.api import TrainingJobSpec


class StateWriter(Protocol):
    """Writes a state dict in the background (background.DcpWriter): returns once the state is staged."""

    def write(self, state_dict: dict[str, Any], directory: Path) -> Future[Any]: ...


class SideState(Protocol):
    """A piece of per-rank state saved beside the engine's tensors (DDP's gradient compression)."""

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...


class LocalState(Protocol):
    """An engine whose state is torch objects this rank can read and write alone (DDP, FSDP2): what the
    memory tier copies, collective-free."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    compression: SideState | None


class Savable(Protocol):
    """An engine as a checkpoint sees it: its job, its device, and how its state goes to and from a directory."""

    spec: TrainingJobSpec
    device: torch.device

    def save(self, path: Path) -> None: ...

    def save_async(self, path: Path, writer: StateWriter) -> Future[Any]: ...

    def load(self, path: Path, saved_world_size: int) -> None: ...

    def local_state(self) -> LocalState | None:
        """The engine's per-rank torch state, or None where its checkpoints are not one file set per rank
        (DeepSpeed)."""
        ...
