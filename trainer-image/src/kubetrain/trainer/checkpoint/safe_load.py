"""Reading checkpoint files without running what a tampered pickle could hold."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from kubetrain.trainer.config import ConfigError


class UntrustedCheckpointError(ConfigError):
    """A checkpoint file that needs objects the trainer never saves. A ConfigError, so the gang exits 2 and
    is not restarted onto the same file."""

    def __init__(self, path: Path, needs: str | None) -> None:
        what = f" ({needs})" if needs else ""
        super().__init__(
            "checkpoint.dir",
            f"refused to load {path}: it holds objects the trainer never saves{what}, so it may have been "
            "tampered with. Nothing in it was run; remove its step directory to resume from an older checkpoint",
        )
        self.path = path


def safe_load(path: Path) -> Any:
    """Read a checkpoint file the trainer wrote with ``torch.save``. Only tensors and plain containers are
    unpickled (weights_only): all the trainer saves is such, and any other object in a pickle can run code
    as it loads, in every later generation, for whoever can write the checkpoint volume."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        raise UntrustedCheckpointError(path, f"it needs {found.group(1)}" if found else None) from exc
