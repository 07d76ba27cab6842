"""spec.lora: LoRA adapters (the ``peft`` library) on a Hugging Face model, its own weights frozen.

The adapters are added to the model while it is still on the meta device (:func:`apply_lora`), before any
engine splits or shards it, so FSDP2 shards base weights and adapters alike, one unit per block (FSDP2 takes
frozen and trainable parameters in one unit), and DDP and DeepSpeed see one model. DeepSpeed ZeRO-3 builds its
model again under ``zero.Init`` (parallel/engines.py): there the adapters are added after that build, whole on
every rank (they are small), filled alike on every rank with no gather, and ``deepspeed.initialize``
partitions them as it does every parameter not yet partitioned.

Initial values depend on the seed and the parameter's name only, as the rest of the trainer's
(model.init_adapters, with :func:`adapter_initial_value`): each ``lora_A`` is drawn whole from its own (seed,
name) generator with peft's default (Kaiming-uniform, a = sqrt(5)), then cut to the part a rank holds; each
``lora_B`` is zero, so training starts from exactly the base model.

This module knows peft and its names, not the trainer's model: model.py imports it (loading a wrapped model's
base weights by their checkpoint names), never the other way round.

**Names (an interface: the model export imports them).** :func:`apply_lora` replaces ``HFCausalLM.inner`` by
peft's ``PeftModelForCausalLM``. Below it a parameter's name (as ``inner.named_parameters()`` gives it) is the
checkpoint's name with ``base_model.model.`` in front and, in each layer that got an adapter, ``.base_layer``
before the weight's own name; the adapters are ``<layer>.lora_A.default.weight`` and
``<layer>.lora_B.default.weight`` (no bias). :func:`checkpoint_name` maps a name back, :func:`is_adapter` tells
which are trained. A torch.distributed.checkpoint state (the engines' ``dcp/``) has the same names with
``inner.`` in front (the HFCausalLM's attribute). To rebuild the model elsewhere: ``build_model(spec.model,
False, seed, meta=...)``, :func:`apply_lora` with the same spec, then load the state (or model.init_adapters).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from kubetrain.core.api import LoraSpec
from kubetrain.trainer.config import ConfigError

if TYPE_CHECKING:
    import peft

log = logging.getLogger("kubetrain.trainer")


@runtime_checkable
class HFCausalLM(Protocol):
    """What this module needs of model.HFCausalLM: the transformers model in ``inner`` (peft's wrapper around it,
    once :func:`apply_lora` has added the adapters)."""

    inner: nn.Module


ADAPTER = "default"
"""peft's name for the one adapter the trainer adds (it appears in the adapters' parameter names)."""
WRAPPED_PREFIX = "base_model.model."
"""What peft's PeftModel puts before every name of the model it wraps."""
BASE_LAYER = ".base_layer."
"""Where peft keeps a wrapped layer's own (frozen) weights: ``q_proj.base_layer.weight`` is ``q_proj.weight``."""
ADAPTER_PARTS = (".lora_A.", ".lora_B.")
"""The adapter parameters the trainer creates and initialises: linear layers' LoRA matrices only."""
ALL_LINEAR = "all-linear"
"""peft's target for every linear layer but the output head: lora.targetModules unset."""


def lora_config(spec: LoraSpec) -> peft.LoraConfig:
    """spec.lora as peft's config: rank r, alpha (scale alpha / r), dropout, target modules (names or name
    suffixes; unset: every linear layer of the blocks, not the head), no bias, for a causal LM."""
    import peft  # noqa: PLC0415 - optional dependency (the image's hf extra)

    return peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha,  # a float: the scale is alpha / r
                           lora_dropout=spec.dropout, target_modules=spec.target_modules or ALL_LINEAR,
                           bias="none", task_type="CAUSAL_LM")


def apply_lora(model: HFCausalLM, spec: LoraSpec) -> None:
    """Wrap ``model.inner`` in peft's adapters (``model.inner`` becomes a PeftModelForCausalLM): every base weight
    frozen (requires_grad False), only the adapters trained. Best on the meta device, before sharding: the
    adapters are then created without storage too and get their values with the rest (model.init_adapters);
    on a model with storage they hold peft's own random initial values until then."""
    import peft  # noqa: PLC0415 - optional dependency

    if is_wrapped(model):
        raise ValueError("the model already carries LoRA adapters")
    # On the meta device the adapters are built there too (peft would otherwise allocate and draw them first).
    on_meta = next(model.inner.parameters()).device.type == "meta"
    where: contextlib.AbstractContextManager[Any] = torch.device("meta") if on_meta else contextlib.nullcontext()
    try:
        with where:
            model.inner = peft.get_peft_model(model.inner, lora_config(spec), adapter_name=ADAPTER)
    except ValueError as exc:  # targets not found, or not a layer type peft adapts
        raise ConfigError("lora.targetModules", str(exc)) from exc
    _check_adapters(model)
    for name, p in model.inner.named_parameters():
        p.requires_grad_(is_adapter(name))


def _check_adapters(model: HFCausalLM) -> None:
    """Only linear layers' LoRA matrices: an embedding or a convolution named in targetModules gets adapters of
    other shapes (lora_embedding_A, ...) that :func:`adapter_initial_value` does not know."""
    import peft  # noqa: PLC0415

    other = sorted(n for n, m in model.inner.named_modules()
                   if isinstance(m, peft.tuners.lora.LoraLayer) and not isinstance(m, peft.tuners.lora.Linear))
    if other:
        raise ConfigError("lora.targetModules", f"only linear layers take adapters here; {other[0]} is a "
                          f"{type(model.inner.get_submodule(other[0])).__name__}")


def is_wrapped(model: HFCausalLM) -> bool:
    """``model.inner`` is peft's wrapper (:func:`apply_lora` was applied)."""
    return type(model.inner).__module__.startswith("peft.")


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` (below ``HFCausalLM.inner``) is a LoRA adapter's, trained and in no
    checkpoint of the base model; every other parameter is a frozen base weight."""
    return any(part in name for part in ADAPTER_PARTS)


def checkpoint_name(name: str) -> str | None:
    """The name in model.hfPath's checkpoint of the base weight (or buffer) called ``name`` below
    ``HFCausalLM.inner`` (``base_model.model.`` dropped, ``.base_layer.`` cut out); None for an adapter's. A name
    of a model without adapters is its checkpoint name already, and comes back unchanged."""
    if is_adapter(name):
        return None
    return name.removeprefix(WRAPPED_PREFIX).replace(BASE_LAYER, ".")


def adapter_initial_value(name: str, shape: torch.Size, generator: torch.Generator,
                          device: torch.device) -> torch.Tensor:
    """The whole initial tensor of adapter parameter ``name``: peft's defaults, drawn from ``generator``:
    lora_A Kaiming-uniform (a = sqrt(5), fan-in: the layer's input width), lora_B zeros (the adapter adds
    nothing at first)."""
    if ".lora_B." in name:
        return torch.zeros(shape, device=device)
    if ".lora_A." not in name:
        raise ValueError(f"{name} is not a LoRA matrix")
    return torch.nn.init.kaiming_uniform_(torch.empty(shape, device=device), a=math.sqrt(5), generator=generator)


def add_adapters(model: nn.Module, spec: LoraSpec | None, announce: bool) -> None:
    """The training loop's part: spec.lora's adapters on the model it built (on the meta device), if spec.lora is
    set, and (``announce``: rank 0) one log line of what they train."""
    if spec is None:
        return
    if not isinstance(model, HFCausalLM):  # the API's rule: lora needs an hfPath model
        raise ConfigError("lora", "LoRA adapters need a Hugging Face model: set model.hfPath or model.hfUri")
    apply_lora(model, spec)
    if announce:
        log.info("lora: rank %d, alpha %g, on %s; %s", spec.rank, spec.alpha,
                 ", ".join(spec.target_modules) if spec.target_modules else f"{ALL_LINEAR} layers of the blocks",
                 trainable_summary(model))


def trainable_summary(model: nn.Module) -> str:
    """How many of the model's parameters are trained, for the log: ``trainable 1,234 of 5,678 parameters
    (21.73%)`` (a tied weight counted once; sizes as built, not as sharded)."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    return f"trainable {trained:,} of {total:,} parameters ({100.0 * trained / max(total, 1):.2f}%)"
