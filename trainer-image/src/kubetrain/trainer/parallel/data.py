"""Data sharding: FSDP2 (``fully_shard``) over the mesh's data-parallel dimension."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.model import transformer_blocks
from kubetrain.trainer.parallel.materialize import on_meta

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def shard_data(model: nn.Module, spec: TrainingJobSpec, device: torch.device, dp_mesh: DeviceMesh,
               amp_dtype: torch.dtype | None) -> nn.Module:
    """``fully_shard`` per block, then the root, over ``dp_mesh`` (tensor-parallel DTensors are sharded
    once more, along the data dimension). A 2-D ``dp_mesh`` (replicate, dp) is HSDP: each parameter sharded
    within a group and replicated across the groups."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard  # noqa: PLC0415

    fs = spec.fsdp
    reshard = fs.reshard_after_forward if fs else True
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda") if fs and fs.cpu_offload else OffloadPolicy()
    )
    if amp_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    if not (fs and fs.cpu_offload) and not on_meta(model):
        model.to(device)  # a model on the meta device gets its storage once sharded (parallel.materialize)
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        # The last block's parameters would be all-gathered again right away by backward: keep them.
        keep = i == len(blocks) - 1
        fully_shard(
            block, mesh=dp_mesh, reshard_after_forward=reshard and not keep, mp_policy=mp, offload_policy=offload
        )
    # The root (embeddings, final norm, head) is never resharded after forward (torch's default for roots).
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    return model
