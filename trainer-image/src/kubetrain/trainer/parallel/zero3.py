"""Defaults for DeepSpeed ZeRO-3's tuning keys, chosen from the model and the world size.

ZeRO-3 runs Python hooks around every module that holds parameters (fetch before forward and backward,
release after) and, by default, replaces ``torch.nn.functional.linear`` with its own autograd function.
On a GPU that host time shows up as step time whenever the GPU waits for the host (ZeRO-3 synchronises
the host at the end of every backward). Each default below cuts host work per step; the measurements
are in docs/benchmarks.md (DeepSpeed ZeRO-3 host overhead) and the table in docs/trainer.md
(The generated DeepSpeed config). The user's ``spec.deepspeed.config`` overrides every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from kubetrain.trainer.model import transformer_blocks


@dataclass(frozen=True)
class ModelFacts:
    largest: int
    """Elements of the largest parameter."""
    block_granularity: int | None
    """DeepSpeed's granularity of the model's coarsest transformer block, when fetching each block as one
    unit leaves every module above the blocks alone; None otherwise (no blocks found, or a parent would
    become one unit too)."""


def _holds_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_container(module: nn.Module) -> bool:
    # DeepSpeed never fetches a ModuleList / ModuleDict / Sequential as one unit: their forward may not run.
    return type(module).__name__ in nn.modules.container.__all__


def granularity(module: nn.Module) -> int:
    """DeepSpeed's measure for stage3_module_granularity_threshold: the module's parameter count divided by
    the modules in it (itself included) that hold parameters, containers not counted. A module whose
    granularity is at most the threshold is fetched and released as one unit, its submodules without hooks."""
    holders = sum(1 for m in module.modules() if _holds_params(m) and not _is_container(m))
    return sum(p.numel() for p in module.parameters()) // max(holders, 1)


def _block_threshold(model: nn.Module) -> int | None:
    blocks = transformer_blocks(model)
    if not blocks:
        return None
    threshold = max(granularity(b) for b in blocks)
    block_ids = {id(b) for b in blocks}
    inside = {id(m) for b in blocks for m in b.modules()} - block_ids
    above = [m for m in model.modules() if id(m) not in inside and id(m) not in block_ids
             and not _is_container(m) and any(id(sub) in block_ids for sub in m.modules())]
    # DeepSpeed picks its units parents first: a parent at or under the threshold would swallow its blocks.
    if any(granularity(m) <= threshold for m in above):
        return None
    return threshold


def model_facts(model: nn.Module) -> ModelFacts:
    largest = max((p.numel() for p in model.parameters()), default=0)
    return ModelFacts(largest=largest, block_granularity=_block_threshold(model))


def zero3_defaults(facts: ModelFacts | None, world_size: int, offload_param: bool) -> dict[str, Any]:
    """The zero_optimization keys kubetrain sets for stage 3 (the user's keys win over them)."""
    out: dict[str, Any] = {}
    if facts is not None and facts.block_granularity is not None:
        # Fetch and release each transformer block as one unit, as FSDP2 shards per block: one hook pair
        # per block instead of one per Linear / LayerNorm (about half the host calls per step).
        out["stage3_module_granularity_threshold"] = facts.block_granularity
    if world_size == 1 and not offload_param and facts is not None:
        # One rank holds every partition whole: gathering is a copy and releasing frees nothing for long.
        # Keep every parameter resident (no per-module gather/release), nothing to overlap a reduction with,
        # and torch's own linear (DeepSpeed's replacement only helps when parameters are released).
        out["stage3_param_persistence_threshold"] = max(facts.largest, 1)
        out["overlap_comm"] = False
        out["memory_efficient_linear"] = False
    return out
