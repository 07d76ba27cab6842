"""The benchmark's model and job: kubetrain's own Transformer and a TrainingJobSpec for it.

Sizes, parameter counts and FLOPs per token come from the trainer package
(kubetrain.trainer.model), so the MFU here is the MFU the trainer reports.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from support.trainer_harness import tiny_spec  # bench/support: a link to tests/support
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer import parallel
from kubetrain.trainer.model import Transformer, build_model, flops_per_token

MFU_FORMULA = (
    "MFU = flops_per_token * tokens_per_second_per_gpu / peak_flops; "
    "flops_per_token = 6*N + 12*L*d*T (PaLM appendix B), N = parameters without the token and position "
    "embeddings (the output head counts: it is a matmul), L layers, d model width, T sequence length"
)


@dataclass(frozen=True)
class Shape:
    """The model and batch: what is trained, not how."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    vocab_size: int
    micro_batch: int
    grad_accum: int
    precision: str
    activation_checkpointing: bool = False
    """spec.activationCheckpointing: each block's activations recomputed in backward."""

    def tokens_per_step(self, world_size: int) -> int:
        return self.micro_batch * self.grad_accum * self.seq_len * world_size


# About 1B parameters, Llama-sized: width 2048, 16 heads of 128, 2048 tokens, a 32000-token vocabulary.
FULL = Shape(d_model=2048, n_layers=18, n_heads=16, seq_len=2048, vocab_size=32000, micro_batch=4, grad_accum=2,
             precision="bf16")
# A few million parameters: seconds per step on a small CPU.
TINY = Shape(d_model=256, n_layers=4, n_heads=4, seq_len=128, vocab_size=256, micro_batch=4, grad_accum=1,
             precision="fp32")


def job_spec(shape: Shape, strategy: str, steps: int) -> TrainingJobSpec:
    """The TrainingJob spec that kubetrain's trainer would run (ZeRO-3 for DeepSpeed)."""
    extra: dict[str, Any] = {"deepspeed": {"zeroStage": 3}} if strategy == "deepspeed" else {}
    wire = tiny_spec(
        strategy=strategy,
        precision=shape.precision,
        microBatchSize=shape.micro_batch,
        gradientAccumulationSteps=shape.grad_accum,
        maxSteps=max(steps, 1),
        activationCheckpointing=shape.activation_checkpointing,
        model={
            "dModel": shape.d_model,
            "nLayers": shape.n_layers,
            "nHeads": shape.n_heads,
            "seqLen": shape.seq_len,
            "vocabSize": shape.vocab_size,
        },
        optimizer={"lr": 3e-4, "minLr": 3e-5},  # a rate a 1B model trains at (the timings do not depend on it)
        **extra,
    )
    spec = TrainingJobSpec.model_validate(wire)
    broken = spec.rule_violations()
    if broken:
        raise ValueError(f"benchmark spec breaks {broken[0][0]}: {broken[0][1]}")
    return spec


def build(spec: TrainingJobSpec, device: torch.device) -> nn.Module:
    """The trainer's model, seeded as the trainer seeds it, created whole on ``device`` (no host round trip): the
    hand-written loop's. The trainer's variants build it on the meta device, as the trainer does (gpu_train.py)."""
    with device:
        return build_model(spec.model, spec.activation_checkpointing, spec.seed)


def compile_blocks(model: nn.Module) -> None:
    """The hand-written loop's torch.compile: the trainer's own (spec.compile), each block in place."""
    parallel.compile_blocks(model)


def describe(spec: TrainingJobSpec) -> dict[str, Any]:
    """Parameter counts and FLOPs per token, from a model on the meta device (no memory, no time)."""
    with torch.device("meta"):
        model = Transformer(spec.model)
    m = spec.model
    return {
        "d_model": m.d_model,
        "n_layers": m.n_layers,
        "n_heads": m.n_heads,
        "seq_len": m.seq_len,
        "vocab_size": m.vocab_size,
        "activation_checkpointing": spec.activation_checkpointing,
        "params_total": model.num_params(exclude_embeddings=False),
        "params_non_embedding": model.num_params(exclude_embeddings=True),
        "flops_per_token": flops_per_token(model, m),
        "attention_flops_per_token": 12 * m.n_layers * m.d_model * m.seq_len,
        "mfu_formula": MFU_FORMULA,
    }


def mfu(flops_per_token: float, tokens_per_second_per_gpu: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation of one device (see MFU_FORMULA); None when the peak is unknown."""
    return flops_per_token * tokens_per_second_per_gpu / peak_flops if peak_flops else None


def compute_dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def attention_backend(shape: Shape, device: torch.device) -> str:
    """The kernel F.scaled_dot_product_attention picks for the model's attention (causal, its heads,
    sequence and compute dtype, with a backward): the first in the dispatcher's priority order that runs."""
    head_dim = shape.d_model // shape.n_heads
    q = torch.randn(1, shape.n_heads, shape.seq_len, head_dim, device=device, dtype=compute_dtype(shape.precision))
    q.requires_grad_(True)
    order = getattr(torch._C, "_get_sdp_priority_order", None)  # private; the documented order otherwise
    backends = [SDPBackend(b) for b in order()] if order else [
        SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH
    ]
    for backend in backends:
        if backend.name in ("OVERRIDEABLE", "ERROR"):
            continue
        with contextlib.suppress(RuntimeError), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # each refusing kernel warns why
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            return backend.name
    return "none"
