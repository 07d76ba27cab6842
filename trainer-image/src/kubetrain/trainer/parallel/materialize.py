"""A model built on the meta device gets its storage only once it is split and sharded.

Each rank allocates just the parts it holds (``to_empty``: its pipeline stage, its tensor-parallel shards, its
FSDP2 shards) and fills them (model.materialize_weights): the built-in model from the seed (each parameter's
whole tensor drawn from its own (seed, name) generator, one at a time, and this rank's part kept), a Hugging Face
model (model.hfPath) from its safetensors files, each rank reading only the slices it holds. No rank ever holds
the whole model, and the weights are the same as the whole model built on one process (torchtitan's
init_weights after parallelize, with a layout-independent draw).
"""

from __future__ import annotations

import torch
from torch import nn

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.model import materialize_weights


def on_meta(model: nn.Module) -> bool:
    """The model was built without storage (model.build_model(meta=True))."""
    return any(p.device.type == "meta" for p in model.parameters())


def materialize(model: nn.Module, spec: TrainingJobSpec, device: torch.device, offload: bool = False) -> nn.Module:
    """Collective for a Hugging Face model. Storage for the parameters this rank holds, on ``device`` (host memory
    with FSDP2's CPU offload), filled with their initial values: seeded, or model.hfPath's."""
    model.to_empty(device=torch.device("cpu") if offload else device)
    materialize_weights(model, spec.model, spec.seed)
    return model
