"""Splitting the model over one DeviceMesh: one function per dimension, applied in one order.

The order is tensor parallelism first (it turns the blocks' projections into DTensors on the mesh's
``tp`` dimension), then data sharding (FSDP2 over the ``dp`` dimension, which shards those DTensors
once more). Activation checkpointing is the model's own (``Transformer.activation_checkpointing``);
it wraps whole blocks, so it composes with both.
"""

from __future__ import annotations

import torch
from torch import nn

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.parallel.data import shard_data
from kubetrain.trainer.parallel.mesh import DP, TP, Layout, build_mesh, copies
from kubetrain.trainer.parallel.tensor import apply_tensor_parallel

__all__ = ["DP", "TP", "Layout", "apply_tensor_parallel", "build_mesh", "copies", "parallelize", "shard_data"]


def parallelize(model: nn.Module, spec: TrainingJobSpec, device: torch.device, layout: Layout,
                amp_dtype: torch.dtype | None) -> nn.Module:
    """Collective (it builds the mesh): ``model`` split over the gang as ``layout`` says, for strategy fsdp."""
    mesh = build_mesh(device.type, layout)
    if layout.tensor > 1:
        model.to(device)  # the shards are cut from the (seeded, identical) full weights on this device
        apply_tensor_parallel(model, mesh[TP])
    return shard_data(model, spec, device, mesh[DP], amp_dtype)
