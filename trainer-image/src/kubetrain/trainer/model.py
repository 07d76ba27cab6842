"""The built-in decoder-only transformer, and the optional Hugging Face causal LM.

Pre-norm blocks, causal attention through ``F.scaled_dot_product_attention``, GELU
MLP, learned positions, untied output head, no dropout (runs are deterministic).
Every parameter lives in a submodule that is *called* (never indexed directly) so
that FSDP2 and ZeRO-3 parameter hooks see every use.

Initial weights depend on the seed and the parameter's name only (:func:`init_weights`): each parameter's
whole tensor is drawn from a generator seeded with (seed, name), then cut to the part a rank holds. So a
model built on the meta device, split and sharded, and only then given storage (parallel/materialize.py)
starts from the same weights as one built whole, whatever the world size or layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kubetrain.core.api import ModelSpec
from kubetrain.trainer import lora
from kubetrain.trainer.config import ConfigError

log = logging.getLogger("kubetrain.trainer")


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

    def __init__(self, spec: ModelSpec, activation_checkpointing: bool = False, seed: int | None = 0) -> None:
        """``seed``: initialise the weights (:func:`init_weights`); None leaves them as built (DeepSpeed's
        zero.Init, where they are initialised once partitioned). Built on the meta device there is nothing to fill."""
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
        if seed is not None and self.head is not None and self.head.weight.device.type != "meta":
            init_weights(self, spec, seed)  # built under torch.device("meta"): no storage to fill

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


def param_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """The generator of parameter ``name``'s initial values: seeded from (seed, name) alone."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return generator


def initial_value(name: str, shape: torch.Size, n_layers: int, generator: torch.Generator,
                  device: torch.device) -> torch.Tensor:
    """The whole initial tensor of the built-in model's parameter ``name``: GPT-2's init (normal, std 0.02, the
    residual projections scaled by 1/sqrt(2 × n_layers)), zero biases, unit norm weights."""
    if len(shape) >= 2:
        std = 0.02 / (2 * n_layers) ** 0.5 if name.endswith(("proj.weight", "out.weight")) else 0.02
        return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)
    return torch.zeros(shape, device=device) if name.endswith("bias") else torch.ones(shape, device=device)


def init_weights(module: nn.Module, spec: ModelSpec, seed: int) -> None:
    """Fill every parameter ``module`` holds (the whole built-in model, a pipeline stage, split and sharded
    or not) with its initial value, each rank its own part (:func:`seed_parameters`)."""
    seed_parameters(module.named_parameters(), seed,
                    lambda name, shape, gen, device: initial_value(name, shape, spec.n_layers, gen, device))


def init_adapters(model: HFCausalLM, seed: int) -> None:
    """Fill every LoRA adapter parameter ``model`` holds (spec.lora: lora.py), whole or sharded, with its initial
    value (lora.adapter_initial_value: peft's defaults) as :func:`init_weights` does. Nothing to do without
    adapters."""
    adapters = ((name, p) for name, p in model.inner.named_parameters() if lora.is_adapter(name))
    seed_parameters(adapters, seed, lora.adapter_initial_value)


def seed_parameters(params: Iterable[tuple[str, nn.Parameter]], seed: int,
                    value: Callable[[str, torch.Size, torch.Generator, torch.device], torch.Tensor]) -> None:
    """Each parameter's whole initial value drawn on this rank's device from its own (seed, name) generator, one
    parameter at a time, and this rank's part kept as its DTensor placements say: the same values whatever the
    world size, strategy or layout."""
    with torch.no_grad():
        for name, p in params:
            local = p.to_local() if hasattr(p, "to_local") else p
            keep_local(p, value(name, p.shape, param_generator(seed, name, local.device), local.device))


def keep_local(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy into ``target`` (a plain tensor, or a DTensor: this rank's part) its part of ``whole``, which every
    rank holds alike: each cuts its own part, no communication; dtype and device converted."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: PLC0415

    local = target.to_local() if isinstance(target, DTensor) else target
    whole = whole.to(local.device, target.dtype)
    if isinstance(target, DTensor):
        whole = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
    with torch.no_grad():
        target.copy_(whole)


def materialize_weights(module: nn.Module, spec: ModelSpec, seed: int) -> None:
    """Values for a model that was built on the meta device and has just been given storage (``to_empty``),
    split and sharded or not: the built-in model's seeded initial weights, or a Hugging Face model's weights
    read from model.hfPath, each rank only what it holds (:func:`load_hf_weights`), and its LoRA adapters', if it
    has any, seeded (:func:`init_adapters`)."""
    if isinstance(module, HFCausalLM):
        load_hf_weights(module, hf_dir(spec))
        init_adapters(module, seed)
    else:
        init_weights(module, spec, seed)


def flops_per_token(model: nn.Module, spec: ModelSpec) -> float:
    """Training FLOPs per token (PaLM appendix B): 6·N_non-embedding + 12·L·d·T (attention), with the model's own
    N, L and d (an hfPath model's from its config, not the built-in model's spec sizes) and T the trained
    sequence length (model.seqLen). A frozen weight (spec.lora's base model) costs 4 per token, not 6: forward and
    the gradient of its input, none of its own."""
    if isinstance(model, HFCausalLM):
        inner: Any = hf_module(model)
        layers, width = hf_sizes(inner.config)
        embed = inner.get_input_embeddings().weight
        weights = [p for p in model.parameters() if p is not embed]
        frozen = sum(p.numel() for p in weights if not p.requires_grad)
        n = sum(p.numel() for p in weights) - frozen / 3  # 6·n = 6·N - 2·frozen
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
    """A Hugging Face causal LM from a local directory, with the same ``forward(tokens, targets)``. ``inner`` is the
    transformers model, or peft's wrapper around it once spec.lora's adapters are added (lora.py; the transformers
    model itself: :func:`hf_module`)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.inner(input_ids=tokens).logits, targets)


def hf_module(model: HFCausalLM) -> Any:
    """The transformers model: ``model.inner``, or the one inside peft's wrapper (lora.apply_lora), whose own
    submodules (``model.layers``, ``model.norm``) are where the families below keep them."""
    inner: Any = model.inner
    return inner.get_base_model() if lora.is_wrapped(model) else inner


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
    root = hf_module(model) if isinstance(model, HFCausalLM) else model
    for name in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        mod = _submodule(root, name)
        if isinstance(mod, nn.ModuleList):
            return list(mod)
    return []


FINAL_NORMS = ("model.norm", "transformer.ln_f", "gpt_neox.final_layer_norm", "model.decoder.final_layer_norm")
"""Where Hugging Face causal LMs keep the norm before their head (the families transformer_blocks knows)."""


def edge_modules(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules around the blocks that this model (or pipeline stage) holds: its input embeddings, and its final
    norm with the output head; ([], []) where the head shares the embedding's weight (one unit must hold both)."""
    if isinstance(model, Transformer):
        return [m for m in (model.tok, model.pos) if m is not None], [m for m in (model.ln_f, model.head) if m is not None]
    if not isinstance(model, HFCausalLM):
        return [], []
    inner: Any = hf_module(model)
    embed, head = inner.get_input_embeddings(), inner.get_output_embeddings()
    if embed is None or head is None or embed.weight is head.weight:
        return [], []
    norms = [m for m in (_submodule(inner, n) for n in FINAL_NORMS) if m is not None]
    return [embed], [*norms[:1], head]


def _submodule(root: nn.Module, dotted: str) -> nn.Module | None:
    mod: nn.Module | None = root
    for part in dotted.split("."):
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod


def build_model(spec: ModelSpec, activation_checkpointing: bool, seed: int, meta: bool = False) -> nn.Module:
    """The model, with the same weights on every rank (seeded, or model.hfPath's). ``meta``: built on the meta
    device, without storage, for the engine to split, shard and only then materialise (parallel/materialize.py:
    :func:`materialize_weights`); otherwise whole, a Hugging Face model loaded in fp32 by ``from_pretrained``."""
    torch.manual_seed(seed)
    if not spec.hf_path:
        if meta:
            with torch.device("meta"):
                return Transformer(spec, activation_checkpointing, seed=None)
        return Transformer(spec, activation_checkpointing, seed=seed)
    if meta:
        return empty_hf_model(spec, activation_checkpointing)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - optional dependency

    inner = AutoModelForCausalLM.from_pretrained(str(hf_dir(spec)), local_files_only=True, dtype=torch.float32)
    return _hf_training(inner, activation_checkpointing)


# --------------------------------------------------------------------------- Hugging Face models, loaded sharded


def hf_dir(spec: ModelSpec) -> Path:
    """model.hfPath, checked: a local directory, and transformers installed."""
    path = Path(str(spec.hf_path))
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("model.hfPath", "needs the `transformers` package, which is not installed in this image")
    if not path.is_dir():
        raise ConfigError("model.hfPath", f"{path} is not a directory (models are loaded from local paths only)")
    return path


def _hf_training(inner: nn.Module, activation_checkpointing: bool) -> HFCausalLM:
    if activation_checkpointing:
        inner.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False})
    return HFCausalLM(inner)


def empty_hf_model(spec: ModelSpec, activation_checkpointing: bool,
                   init: contextlib.AbstractContextManager[Any] | None = None) -> HFCausalLM:
    """model.hfPath's model built from its config alone, fp32, without its weights: on the meta device, or under
    ``init`` (DeepSpeed's ``zero.Init``, which partitions each parameter as its module is built) with
    transformers' random initialisation skipped. Tied weights (``tie_word_embeddings``) are one parameter."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 - optional dependency
    from transformers import initialization as hf_init  # noqa: PLC0415

    config = AutoConfig.from_pretrained(str(hf_dir(spec)), local_files_only=True)
    with contextlib.ExitStack() as stack:
        if init is None:
            stack.enter_context(torch.device("meta"))  # transformers' own meta build: no init, weights tied
            stack.enter_context(getattr(hf_init, "meta_device_safe_creation_ops", contextlib.nullcontext)())
        else:
            stack.enter_context(hf_init.no_init_weights())  # no random init (and no tying: done below)
            stack.enter_context(init)
        inner = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    inner.tie_weights()
    return _hf_training(inner, activation_checkpointing)


def hf_targets(model: HFCausalLM) -> dict[str, torch.Tensor]:
    """What a checkpoint fills, by its names in model.hfPath's files (``inner.`` dropped; with LoRA adapters, the
    base weights under their names before peft wrapped them: lora.checkpoint_name): every parameter (a tied one
    once, under its first name) and every persistent buffer; no adapter (:func:`init_adapters` fills those)."""
    inner = model.inner
    persistent = set(inner.state_dict(keep_vars=True))
    held = [*inner.named_parameters(), *((n, b) for n, b in inner.named_buffers() if n in persistent)]
    return {target: t for name, t in held if (target := lora.checkpoint_name(name)) is not None}


def hf_files(model: HFCausalLM, path: Path) -> dict[str, Path] | None:
    """Which safetensors file of ``path`` holds each of :func:`hf_targets`' names (one file, or shards with
    model.safetensors.index.json); None, with a warning that says why, when they cannot be read by name and
    slice: no safetensors (a pytorch_model.bin), or names missing (a checkpoint whose names transformers
    converts while loading)."""
    from safetensors import safe_open  # noqa: PLC0415 - transformers' own dependency

    files: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            files.update((key, file) for key in f.keys())  # noqa: SIM118 - safe_open is no Mapping
    missing = sorted(set(hf_targets(model)) - set(files))
    if files and not missing:
        return files
    reason = f"{len(missing)} weights not in its safetensors files, e.g. {missing[0]}" if files else \
        "no *.safetensors files"
    log.warning("model.hfPath %s: %s; every process loads the whole model (from_pretrained) and keeps its part",
                path, reason)
    return None


def hf_reader(path: Path, files: dict[str, Path] | None) -> Callable[[str], torch.Tensor]:
    """Whole tensors of model.hfPath by name, in the checkpoint's dtype: from their safetensors file, one at a
    time, or (``files`` None: :func:`hf_files`) from the whole model loaded once by ``from_pretrained``."""
    if files is None:
        from transformers import AutoModelForCausalLM  # noqa: PLC0415 - optional dependency

        whole = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype="auto").state_dict()
        return whole.__getitem__

    def read(name: str) -> torch.Tensor:
        from safetensors import safe_open  # noqa: PLC0415

        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name)

    return read


def load_hf_weights(model: HFCausalLM, path: Path) -> None:
    """Fill a Hugging Face model built on the meta device (:func:`empty_hf_model`), split and sharded, then given
    storage, with model.hfPath's weights. Collective. Each rank reads only the slices it holds from the
    safetensors files (torch.distributed.checkpoint's HuggingFaceStorageReader: one read per slice, in the
    checkpoint's dtype, converted to the parameter's fp32 on this rank), then recomputes the buffers that are
    no checkpoint's (rotary frequencies). Without readable safetensors (:func:`hf_files`) each rank loads the
    whole model in the checkpoint's dtype and keeps its part."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        # Whole (DDP, ZeRO 0-2): to_empty gave each module a parameter of its own, so tie again what the config
        # ties (FSDP2's to_empty keeps a shared parameter shared).
        hf_module(model).tie_weights()
    files = hf_files(model, path)
    with torch.no_grad():
        if files is not None:
            state = {name: t.detach() for name, t in hf_targets(model).items()}
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
        else:
            read = hf_reader(path, None)
            for name, target in hf_targets(model).items():
                keep_local(target, read(name))
    recompute_buffers(model)


def recompute_buffers(model: HFCausalLM) -> None:
    """Compute again the non-persistent buffers (RoPE's ``inv_freq``) that ``to_empty`` left uninitialised and no
    checkpoint holds, as ``from_pretrained`` does: transformers' ``_init_weights`` of each module that owns one,
    by the nearest PreTrainedModel above it, with the module's own (loaded) parameters marked as initialised."""
    from transformers import PreTrainedModel  # noqa: PLC0415 - optional dependency
    from transformers import initialization as hf_init  # noqa: PLC0415

    owner: dict[str, Any] = {}
    base = hf_module(model)
    with torch.no_grad(), hf_init.guard_torch_init_functions():
        for name, module in base.named_modules():
            parent = owner.get(name.rpartition(".")[0], base)
            owner[name] = module if isinstance(module, PreTrainedModel) else parent
            if not module._non_persistent_buffers_set:
                continue
            own = [p for p in module.parameters(recurse=False) if not getattr(p, "_is_hf_initialized", False)]
            for p in own:
                p._is_hf_initialized = True
            owner[name]._init_weights(module)
            for p in own:
                del p._is_hf_initialized
