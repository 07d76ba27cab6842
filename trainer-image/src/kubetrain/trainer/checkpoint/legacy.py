"""Checkpoints of the built-in model that earlier trainers wrote, loaded into this trainer's layout.

The built-in model's attention had one fused projection, `attn.qkv` (weight rows [q; k; v], bias likewise);
it now has `attn.q`, `attn.k` and `attn.v`, which tensor parallelism can split by heads. A job that runs
on across an upgrade resumes from a checkpoint of the fused layout: each rank reads the fused tensors of
the model and of the optimizer whole, splits them by rows and keeps its own shards of q, k and v; every
other tensor loads as usual, straight into its shard. Only the fused tensors are read whole (a few
d_model x d_model matrices per block), once, on the first resume after the upgrade.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

FUSED = ".attn.qkv."
SPLIT = (".attn.q.", ".attn.k.", ".attn.v.")


def is_fused(dcp_dir: Path) -> bool:
    """Whether the DCP checkpoint in `dcp_dir` holds the fused attention (False when unreadable: the load's
    own error says more)."""
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415

    try:
        keys = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001
        return False
    return any(FUSED in key for key in keys)


def load_fused(state: dict[str, Any], dcp_dir: Path) -> None:
    """Fill `state` ({"model": ..., "optim": ...} as get_state_dict gives them, sharded) from a checkpoint
    of the fused layout."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    groups = state["optim"]["param_groups"]
    template = {"model": _fuse(state["model"]),
                "optim": {"state": _fuse(state["optim"]["state"]), "param_groups": copy.deepcopy(groups)}}
    dcp.load(template, checkpoint_id=str(dcp_dir))
    _split_into(state["model"], template["model"])
    for fqn, per_param in state["optim"]["state"].items():
        if (part := _part(fqn)) is not None:
            _split_into(per_param, template["optim"]["state"][_fused_name(fqn)], part=part)
    # The saved groups list the fused parameter, the optimizer's own the three: keep those, take the rest.
    for group, loaded in zip(groups, template["optim"]["param_groups"], strict=True):
        group.update({k: v for k, v in loaded.items() if k != "params"})


def _part(fqn: str) -> int | None:
    """0, 1 or 2 for a name of q, k or v's parameters; None for any other."""
    return next((i for i, s in enumerate(SPLIT) if s in fqn), None)


def _fused_name(fqn: str) -> str:
    part = _part(fqn)
    return fqn if part is None else fqn.replace(SPLIT[part], FUSED)


def _fuse(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` with q, k and v's entries replaced by one fused entry of three times their rows, read whole
    (a plain CPU tensor); the other entries as they are (DCP loads them into their shards)."""
    out: dict[str, Any] = {}
    for fqn, value in tensors.items():
        part = _part(fqn)
        if part is None:
            out[fqn] = value
        elif part == 0:
            out[_fused_name(fqn)] = _whole(value, rows=3)
    return out


def _whole(value: Any, rows: int) -> Any:
    if isinstance(value, dict):  # an optimizer's per-parameter state
        return {k: _whole(v, rows) if isinstance(v, torch.Tensor) and v.dim() > 0 else _copy(v) for k, v in value.items()}
    shape = list(value.shape)
    shape[0] *= rows
    return torch.empty(shape, dtype=value.dtype)


def _copy(value: Any) -> Any:
    return value.full_tensor().clone() if hasattr(value, "full_tensor") else (
        value.clone() if isinstance(value, torch.Tensor) else value)


def _split_into(targets: dict[str, Any], fused: dict[str, Any], part: int | None = None) -> None:
    """Copy each q, k or v entry of `targets` (its local shard) from its third of the fused tensor; `part`:
    the third for every entry (an optimizer's per-parameter state), else taken from each entry's name."""
    for key, target in targets.items():
        third = _part(key) if part is None else part
        if third is None or not isinstance(target, torch.Tensor):
            continue
        source = fused[_fused_name(key)] if part is None else fused[key]
        if target.dim() == 0:  # the optimizer's step count: the fused parameter's
            _assign(target, source.to(target.dtype))
            continue
        _assign(target, source.chunk(3, dim=0)[third])


def _assign(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy `whole` (the full tensor) into `target`: a plain tensor, or this rank's shard of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: PLC0415

    if isinstance(target, DTensor):
        mine = distribute_tensor(whole.to(target.device, target.dtype), target.device_mesh, target.placements,
                                 src_data_rank=None)  # every rank holds the whole: each keeps its slice
        target.to_local().copy_(mine.to_local())
    else:
        target.copy_(whole.to(target.device, target.dtype))
