"""Read a torch.distributed.checkpoint directory in the test process (no process group) and compare two
state dicts exactly: every tensor bit for bit, every other value equal."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch


def read_dcp(directory: Path) -> dict[str, Any]:
    """The whole state dict a DCP directory holds, unsharded (DTensor shards joined), on CPU."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="kt-dcp-") as tmp:
        out = Path(tmp) / "state.pt"
        dcp_to_torch_save(directory, out)
        return torch.load(out, weights_only=False, map_location="cpu")


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (empty: identical): keys, types, tensor dtype/shape/bits, values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where or "(root)"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))[:5]}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def count_tensors(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return 1
    if isinstance(state, dict):
        return sum(count_tensors(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(count_tensors(v) for v in state)
    return 0
