"""Tensor parallelism (Megatron-style, with DTensor's parallel styles): one block plan per model family.

In every block, the attention's q, k and v projections and the MLP's first layers are split by output
columns (each rank computes its heads / its share of the hidden units from the whole input), and the
attention's output projection and the MLP's last layer by input rows (each rank's partial sums are
all-reduced into the block's replicated output). That is two all-reduces per block forward and two in
backward. Embeddings, norms and the output head stay replicated: every rank of a group computes them on
the same batch, and their gradients come out equal on every rank (the column-parallel layers' input
gradients are all-reduced), so no extra synchronisation is needed.

The built-in model has one plan; a Hugging Face model (model.hfPath) gets its family's, chosen by its
config's ``model_type``. The Llama family (Llama, Mistral, Qwen2, Qwen3) names its projections alike, and
its attention reshapes to ``(..., -1, head_dim)``, so a rank's local shard holds whole heads and its
query-per-key/value-head ratio is the whole model's, as long as T divides both head counts. Qwen3 also
normalises each query and key head (``q_norm``/``k_norm``, one weight over head_dim): a rank sees only its
own heads there, so those weights become replicated DTensors over shards of the heads dimension
(SequenceParallel on that dimension), whose gradients DTensor sums over the group; as plain tensors each
rank would keep the partial sum of its own heads and the copies would drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.model import HFCausalLM, Transformer, own_blocks, transformer_blocks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def block_plan() -> dict[str, object]:
    """Each built-in block's submodule -> its parallel style."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: PLC0415

    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.out": RowwiseParallel(),
    }


def llama_block_plan() -> dict[str, object]:
    """Each HF Llama-family decoder layer's submodule -> its parallel style (torchtitan's Llama plan, wq/wk/wv/w1/w3
    column-wise and wo/w2 row-wise, under HF's names)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: PLC0415

    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def qwen3_block_plan() -> dict[str, object]:
    """Llama's plan, and the per-head norms over the local heads: they see ``(batch, seq, heads, head_dim)``."""
    from torch.distributed.tensor.parallel import SequenceParallel  # noqa: PLC0415

    heads_dim = 2
    return {
        **llama_block_plan(),
        "self_attn.q_norm": SequenceParallel(sequence_dim=heads_dim, use_local_output=True),
        "self_attn.k_norm": SequenceParallel(sequence_dim=heads_dim, use_local_output=True),
    }


HF_PLANS: dict[str, Callable[[], dict[str, object]]] = {
    "llama": llama_block_plan,
    "mistral": llama_block_plan,
    "qwen2": llama_block_plan,
    "qwen3": qwen3_block_plan,
}
"""Hugging Face ``model_type`` -> its decoder layers' plan."""


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every block of ``model`` over ``tp_mesh`` in place (the blocks' projections become DTensors)."""
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415

    if isinstance(model, HFCausalLM):
        blocks, plan = transformer_blocks(model), hf_plan(model.inner.config, tp_mesh.size())
    elif isinstance(model, Transformer):
        if model.n_heads % tp_mesh.size():
            raise ConfigError("parallelism.tensor", f"{tp_mesh.size()} does not divide model.nHeads {model.n_heads}")
        blocks, plan = own_blocks(model), block_plan()  # a pipeline stage's own blocks
    else:
        raise ConfigError("parallelism.tensor", f"no tensor-parallel plan for {type(model).__name__}")
    for block in blocks:
        missing = [name for name in plan if not _has_submodule(block, name)]
        if missing:
            raise ConfigError("parallelism.tensor", f"a {type(block).__name__} block has no {', '.join(missing)}")
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]


def hf_plan(config: Any, tensor: int) -> dict[str, object]:
    """The block plan for a Hugging Face model of ``config`` split over ``tensor`` processes, or a ConfigError
    naming model.hfPath's model type, or the head counts T must divide."""
    family = getattr(config, "model_type", None)
    if family not in HF_PLANS:
        where = getattr(config, "name_or_path", "") or "(its directory)"
        raise ConfigError("parallelism.tensor", f"model.hfPath {where} is a {family!r} model; tensor parallelism "
                          f"supports the built-in model and the Hugging Face model types {', '.join(HF_PLANS)}: "
                          "use parallelism.tensor 1")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tensor or kv_heads % tensor:
        raise ConfigError("parallelism.tensor", f"{tensor} must divide both num_attention_heads {heads} and "
                          f"num_key_value_heads {kv_heads} of model.hfPath's config (each process computes whole "
                          "query heads and the key/value heads they share)")
    return HF_PLANS[family]()


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True
