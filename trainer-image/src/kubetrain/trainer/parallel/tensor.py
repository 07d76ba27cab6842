"""Tensor parallelism for the built-in model (Megatron-style, with DTensor's parallel styles).

In every block, the attention's q, k and v projections and the MLP's first layer are split by output
columns (each rank computes its heads / its quarter of the hidden units from the whole input), and the
attention's output projection and the MLP's second layer by input rows (each rank's partial sums are
all-reduced into the block's replicated output). That is two all-reduces per block forward and two in
backward. Embeddings, layer norms and the output head stay replicated: every rank of a group computes
them on the same batch, and their gradients come out equal on every rank (the column-parallel layers'
input gradients are all-reduced), so no extra synchronisation is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.model import Transformer, own_blocks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def block_plan() -> dict[str, object]:
    """Each block's submodule -> its parallel style."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: PLC0415

    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.out": RowwiseParallel(),
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every block of ``model`` over ``tp_mesh`` in place (the blocks' projections become DTensors)."""
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415

    if not isinstance(model, Transformer):
        raise ConfigError("parallelism.tensor", "tensor parallelism supports the built-in model only (not model.hfPath)")
    if model.n_heads % tp_mesh.size():
        raise ConfigError("parallelism.tensor", f"{tp_mesh.size()} does not divide model.nHeads {model.n_heads}")
    for block in own_blocks(model):  # a pipeline stage's own blocks
        parallelize_module(block, tp_mesh, block_plan())  # type: ignore[arg-type]
