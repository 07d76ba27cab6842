"""The built-in decoder-only transformer, and the optional Hugging Face causal LM.

Pre-norm blocks, causal attention through ``F.scaled_dot_product_attention``, GELU
MLP, learned positions, untied output head, no dropout (runs are deterministic).
Every parameter lives in a submodule that is *called* (never indexed directly) so
that FSDP2 and ZeRO-3 parameter hooks see every use.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kubetrain.core.api import ModelSpec
from kubetrain.trainer.config import ConfigError


class Attention(nn.Module):
    """Separate q, k and v projections (not one fused one) so that tensor parallelism can split each by
    heads: a column split of a fused [q|k|v] weight would give a process q of every head and no v."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        # The heads this process holds: all of them, or 1/T of them under tensor parallelism.
        b, t, width = y.shape
        return y.view(b, t, width // self.head_dim, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b, heads, t, hd = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * hd))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy, in fp32."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def own_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks a model holds, in order: a pipeline stage keeps its own in a ModuleDict under their original
    indices (so their parameter names, and a checkpoint's, stay those of the whole model)."""
    blocks = model.blocks
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    assert isinstance(blocks, nn.ModuleList)
    return list(blocks)


class Transformer(nn.Module):
    """``forward(tokens, targets)`` returns the mean next-token cross-entropy (fp32)."""

    def __init__(self, spec: ModelSpec, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.seq_len = spec.seq_len
        self.activation_checkpointing = activation_checkpointing
        # None on a pipeline stage that does not own them (parallel.pipeline)
        self.tok: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos: nn.Embedding | None = nn.Embedding(spec.seq_len, spec.d_model)
        self.blocks = nn.ModuleList(Block(spec.d_model, spec.n_heads) for _ in range(spec.n_layers))
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(spec.d_model)
        self.head: nn.Linear | None = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        self.n_layers = spec.n_layers
        self.n_heads = spec.n_heads
        self.d_model = spec.d_model
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02
                if name.endswith("proj.weight") or name.endswith("out.weight"):
                    std = 0.02 / (2 * self.n_layers) ** 0.5  # GPT-2 style scaled residual projections
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss; without ``targets``, what this module's part of the model outputs. A pipeline stage
        (parallel.pipeline) lacks the parts it does not own: without embeddings ``tokens`` are the previous
        stage's hidden states, and without the head the hidden states are returned."""
        x = tokens
        if self.tok is not None and self.pos is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.tok(tokens) + self.pos(positions)
        for block in own_blocks(self):
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.head is None or self.ln_f is None:
            return x
        logits = self.head(self.ln_f(x))
        return logits if targets is None else lm_loss(logits, targets)

    def num_params(self, exclude_embeddings: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= sum(e.weight.numel() for e in (self.tok, self.pos) if e is not None)
        return n


def flops_per_token(model: nn.Module, spec: ModelSpec) -> float:
    """Training FLOPs per token (PaLM appendix B): 6·N_non-embedding + 12·L·d·T (attention), with the model's own
    N, L and d (an hfPath model's from its config, not the built-in model's spec sizes) and T the trained
    sequence length (model.seqLen)."""
    if isinstance(model, HFCausalLM):
        inner: Any = model.inner
        layers, width = hf_sizes(inner.config)
        n = sum(p.numel() for p in model.parameters()) - int(inner.get_input_embeddings().weight.numel())
    elif isinstance(model, Transformer):
        n, layers, width = model.num_params(exclude_embeddings=True), model.n_layers, model.d_model
    else:
        n, layers, width = sum(p.numel() for p in model.parameters()), spec.n_layers, spec.d_model
    return 6.0 * n + 12.0 * layers * width * spec.seq_len


def hf_sizes(config: Any) -> tuple[int, int]:
    """A Hugging Face config's layers and attention width (heads x head size: hidden_size unless the config sets
    its own head_dim); a multimodal config's text model's."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, hidden = int(text.num_hidden_layers), int(text.hidden_size)
    head_dim = getattr(text, "head_dim", None)
    return layers, int(text.num_attention_heads) * int(head_dim) if head_dim else hidden


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM from a local directory, with the same ``forward(tokens, targets)``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.inner(input_ids=tokens).logits, targets)


def vocab_size(model: nn.Module) -> int:
    """How many token ids the model's embedding takes."""
    if isinstance(model, HFCausalLM):
        embeddings: Any = model.inner.get_input_embeddings()  # type: ignore[operator]
        return int(embeddings.num_embeddings)
    assert isinstance(model, Transformer) and model.tok is not None  # the whole model, before any split
    return int(model.tok.num_embeddings)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard / checkpoint one by one."""
    if isinstance(model, Transformer):
        return own_blocks(model)
    for name in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        mod: nn.Module | None = model.inner if isinstance(model, HFCausalLM) else model
        for part in name.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if isinstance(mod, nn.ModuleList):
            return list(mod)
    return []


def build_model(spec: ModelSpec, activation_checkpointing: bool, seed: int) -> nn.Module:
    """The model, initialised identically on every rank (seeded)."""
    torch.manual_seed(seed)
    if not spec.hf_path:
        return Transformer(spec, activation_checkpointing)
    path = Path(spec.hf_path)
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("model.hfPath", "needs the `transformers` package, which is not installed in this image")
    if not path.is_dir():
        raise ConfigError("model.hfPath", f"{path} is not a directory (models are loaded from local paths only)")
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - optional dependency

    inner = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, torch_dtype=torch.float32)
    if activation_checkpointing:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return HFCausalLM(inner)
