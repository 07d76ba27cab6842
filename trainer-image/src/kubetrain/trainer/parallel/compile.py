"""spec.compile: torch.compile of each transformer block, in place.

Each block is compiled on its own (``nn.Module.compile``) rather than the whole model: the blocks are alike,
so Inductor compiles one graph and reuses it for every block, and the collectives FSDP2 runs around each block
(its hooks, which Dynamo leaves out of the graph) stay where they are. Compiling in place keeps the
parameters' names, so checkpoints of compiled and eager runs read each other. It comes after tensor
parallelism (the graph sees the DTensor projections) and activation checkpointing (applied around each
block's call, so a recomputation runs the compiled block again), and before FSDP2 or DDP wraps the model.
"""

from __future__ import annotations

from torch import nn

from kubetrain.trainer.model import transformer_blocks


def compile_blocks(model: nn.Module) -> int:
    """Compile every block of ``model`` (a pipeline stage: its own) in place; how many there were. The
    compilation itself happens at the first call (the first step, and again at the first evaluation)."""
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)
