"""Splitting the model over one DeviceMesh: one function per dimension, applied in one order.

The order is the pipeline split first (each rank keeps its stage's part of the model), then tensor parallelism
(it turns the blocks' projections into DTensors on the mesh's ``tp`` dimension), then spec.compile (each block,
in place), then data sharding (FSDP2 over the ``dp`` dimension, which shards those DTensors once more; HSDP over
the ``replicate`` and ``dp`` dimensions; or DDP, through :func:`replicate`), and last, for a model built on the
meta device, its storage (materialize.py): each rank allocates and fills only what it holds. Activation
checkpointing is the model's own (``Transformer.activation_checkpointing``); it wraps whole blocks, so it
composes with all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.parallel.compile import compile_blocks
from kubetrain.trainer.parallel.data import shard_data
from kubetrain.trainer.parallel.materialize import materialize, on_meta
from kubetrain.trainer.parallel.mesh import DP, PP, REPLICATE, TP, Layout, build_mesh, copies, data_mesh
from kubetrain.trainer.parallel.pipeline import Pipeline, RankPart, rank_stages, split_stages, virtual_stages
from kubetrain.trainer.parallel.tensor import apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DP", "PP", "REPLICATE", "TP", "Layout", "Pipeline", "apply_tensor_parallel", "build_mesh", "compile_blocks", "copies",
           "materialize", "on_meta", "parallelize", "parallelize_pipeline", "replicate", "shard_data"]


def parallelize(model: nn.Module, spec: TrainingJobSpec, device: torch.device, layout: Layout,
                amp_dtype: torch.dtype | None) -> nn.Module:
    """Collective (it builds the mesh): ``model`` split over the gang as ``layout`` says, for strategy fsdp
    without pipeline parallelism."""
    return _tensor_and_data(model, spec, device, build_mesh(device.type, layout), layout, amp_dtype)


def parallelize_pipeline(model: nn.Module, spec: TrainingJobSpec, device: torch.device, layout: Layout,
                         amp_dtype: torch.dtype | None) -> tuple[nn.Module, Pipeline]:
    """Collective: this rank's pipeline stages of ``model`` (one module under the whole model's names),
    each split further as ``layout`` says, and the schedule that runs them (``layout.pipeline`` > 1)."""
    mesh = build_mesh(device.type, layout)
    schedule = spec.parallelism.pipeline_schedule
    stages = rank_stages(layout.pipeline_rank(dist.get_rank()), layout.pipeline, schedule)
    modules = split_stages(model, stages, layout.pipeline * virtual_stages(schedule))
    for module in modules:
        _tensor_and_data(module, spec, device, mesh, layout, amp_dtype)
    pipeline = Pipeline(modules, stages, mesh[PP], device, schedule, spec.gradient_accumulation_steps)
    return RankPart(modules), pipeline


def _tensor_and_data(model: nn.Module, spec: TrainingJobSpec, device: torch.device, mesh: DeviceMesh,
                     layout: Layout, amp_dtype: torch.dtype | None) -> nn.Module:
    meta = on_meta(model)
    if layout.tensor > 1:
        if not meta:  # the shards are cut from the (seeded, identical) full weights on this device
            model.to(device)
        apply_tensor_parallel(model, mesh[TP])
    if spec.compile:
        compile_blocks(model)
    model = shard_data(model, spec, device, data_mesh(mesh, layout), amp_dtype)
    if meta:
        materialize(model, spec, device, offload=bool(spec.fsdp and spec.fsdp.cpu_offload))
    return model


def replicate(model: nn.Module, spec: TrainingJobSpec, device: torch.device, **ddp_options: Any) -> nn.Module:
    """Strategy ddp: ``model`` on ``device`` (its blocks compiled when spec.compile says so), wrapped in
    DistributedDataParallel with ``ddp_options`` (gradient compression's)."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    if on_meta(model):
        materialize(model, spec, device)
    else:
        model.to(device)
    if spec.compile:
        compile_blocks(model)
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, **ddp_options)
