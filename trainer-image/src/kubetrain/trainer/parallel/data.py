"""Data sharding: FSDP2 (``fully_shard``) over the mesh's data-parallel dimension."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.model import edge_modules, transformer_blocks
from kubetrain.trainer.parallel.materialize import on_meta

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def shard_data(model: nn.Module, spec: TrainingJobSpec, device: torch.device, dp_mesh: DeviceMesh,
               amp_dtype: torch.dtype | None) -> nn.Module:
    """``fully_shard`` of the embeddings, each block, the final norm with the head, then the root, over ``dp_mesh`` (tensor-parallel DTensors are sharded
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
    inputs, outputs = edge_modules(model)
    # The embeddings are a unit of their own (gathered for forward, and again only at the end of backward), the
    # blocks one each, the final norm with the head one more: what stays gathered at a time is a unit, never the
    # whole model's edges (torchtitan's units). Backward gathers the last block and the head again right away:
    # they are kept. A head tied to the embedding stays in the root with it.
    units = [(inputs, reshard)] if inputs else []
    blocks = transformer_blocks(model)
    units += [([block], reshard and i < len(blocks) - 1) for i, block in enumerate(blocks)]
    units += [(outputs, False)] if outputs else []
    for modules, reshard_after in units:
        fully_shard(modules, mesh=dp_mesh, reshard_after_forward=reshard_after, mp_policy=mp, offload_policy=offload)
    # The root holds what is left (a tied embedding and head); never resharded after forward (torch's default).
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    return model
