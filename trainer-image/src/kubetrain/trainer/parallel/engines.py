"""One interface over the three strategies: DDP, FSDP2 (``fully_shard``) and DeepSpeed ZeRO.

An engine owns the wrapped model, optimizer, LR scheduler and (fp16) loss scaler.
The training loop calls :meth:`Engine.forward_backward` with the step's micro
batches, then :meth:`Engine.optimizer_step`; :meth:`Engine.save` / :meth:`Engine.load`
write and read the model/optimizer/scheduler/scaler part of a checkpoint directory.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import sys
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from kubetrain.core.api import FSDPSpec, TrainingJobSpec
from kubetrain.trainer import parallel
from kubetrain.trainer.checkpoint import legacy
from kubetrain.trainer.checkpoint.safe_load import safe_load
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.lora import apply_lora
from kubetrain.trainer.model import (
    HFCausalLM,
    Transformer,
    empty_hf_model,
    hf_dir,
    hf_files,
    hf_module,
    hf_reader,
    hf_targets,
    init_adapters,
    initial_value,
    param_generator,
    recompute_buffers,
)
from kubetrain.trainer.parallel import compression, zero3
from kubetrain.trainer.schedule import lr_factor

if TYPE_CHECKING:
    from kubetrain.trainer.checkpoint.savable import LocalState, StateWriter

DEFAULT_FP16_INIT_SCALE = 2.0**16
FP16_INIT_SCALE_ENV = "KUBETRAIN_FP16_INIT_SCALE"
"""Initial dynamic loss scale for fp16 (tests set a huge one to force overflow steps)."""
DEEPSPEED_SHM_ENV = "KUBETRAIN_DEEPSPEED_SHM"
"""Set to "1" to let DeepSpeed build its CPU shared-memory comm op (inference only; slow JIT build)."""


@dataclass
class StepInfo:
    grad_norm: float | torch.Tensor | None
    """The global gradient norm before clipping; on a GPU a device tensor that the loop reads after the step's
    loss (one device-to-host wait per step, not one more)."""
    skipped: bool = False
    """The optimizer step was skipped (fp16 overflow)."""
    loss_scale: float | None = None
    """Loss scale after this step (fp16 only)."""
    allreduce_bytes: int | None = None
    """Gradient bytes this rank passed to all-reduce in this step (DDP only; after compression)."""


def _fp16_init_scale() -> float:
    raw = os.environ.get(FP16_INIT_SCALE_ENV)
    return float(raw) if raw else DEFAULT_FP16_INIT_SCALE


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Parameter dtypes torch's fused AdamW kernel takes."""


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""spec.precision -> the dtype the model computes in (fp32: none)."""


def fused_adamw(device_types: Iterable[str], dtypes: Iterable[torch.dtype], offloaded: bool = False) -> bool:
    """Whether AdamW runs torch's fused kernel (a few launches per step instead of a foreach chain): every
    parameter on CUDA in a floating dtype, and the optimizer not offloaded to the host (DeepSpeed's
    offload_optimizer steps host copies). Elsewhere (CPU) torch's default stays."""
    kinds, types = list(device_types), list(dtypes)
    return bool(kinds) and not offloaded and all(k == "cuda" for k in kinds) and all(t in FUSED_DTYPES for t in types)


def make_optimizer(params: Any, spec: TrainingJobSpec) -> torch.optim.Optimizer:
    """AdamW over those of ``params`` that train (requires_grad): with spec.lora the adapters alone, so no state is
    kept for the frozen base weights (and the checkpoints' optimizer state holds the adapters' only)."""
    o = spec.optimizer
    params = [p for p in params if p.requires_grad]
    offloaded = spec.strategy == "deepspeed" and bool(spec.deepspeed and spec.deepspeed.offload_optimizer)
    fused = fused_adamw([p.device.type for p in params], [p.dtype for p in params], offloaded)
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=1e-8, weight_decay=o.weight_decay,
                             fused=fused or None)  # None: torch's default (foreach), as before


def make_scheduler(optimizer: torch.optim.Optimizer, spec: TrainingJobSpec) -> LambdaLR:
    opt, max_steps = spec.optimizer, spec.max_steps
    return LambdaLR(optimizer, lambda s: lr_factor(s, opt, max_steps))


class Engine:
    model: nn.Module
    spec: TrainingJobSpec
    device: torch.device

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward + backward over the micro-batches; the local mean loss (0-dim fp32 tensor)."""
        raise NotImplementedError

    def optimizer_step(self) -> StepInfo:
        raise NotImplementedError

    def eval_loss(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The local mean loss over the micro-batches, no gradients (0-dim fp32 tensor)."""
        raise NotImplementedError

    def lr(self) -> float:
        raise NotImplementedError

    def save(self, path: Path) -> None:
        raise NotImplementedError

    def save_async(self, path: Path, writer: StateWriter) -> Future[Any]:
        """Strategies ddp and fsdp (checkpoint/background.py: BACKGROUND_STRATEGIES): stage now, write in the background."""
        raise NotImplementedError

    def load(self, path: Path, saved_world_size: int) -> None:
        raise NotImplementedError

    def local_state(self) -> LocalState | None:
        """This engine's per-rank torch state for the memory tier (checkpoint/savable.py); None by default."""
        return None

    pipeline_degree: int = 1
    """Pipeline stages (parallelism.pipeline): each rank holds one stage's parameters."""

    @property
    def loss_weight(self) -> float:
        """How much this rank's loss counts in the mean over ranks: 1, and 0 on a pipeline stage that
        computes none (all but the last)."""
        return 1.0

    def local_param_sq_norm(self) -> float:
        """Sum of squares of this rank's parameter shard, each element divided by the ranks that hold it
        (a DTensor's copies): summed over the gang, every element counts once (for debugging / tests)."""
        total = 0.0
        for p in self.model.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            total += float(t.detach().float().pow(2).sum()) / parallel.copies(p, self.pipeline_degree)
        return total


def grad_norm(grads: list[torch.Tensor], pipeline: int = 1) -> torch.Tensor:
    """The global L2 norm of the gradients, the same number on every rank: a 0-dim float64 tensor on the
    gradients' device (the all-reduce's under FSDP2 CPU offload), read by the caller when it waits anyway.

    Plain tensors (DDP) are whole on every rank. DTensors (FSDP2, tensor parallelism) are reduced by one
    all-reduce of every rank's local squares, each element counted once over the gang (parallel.copies):
    DTensor's own reduction would take one collective per mesh (the blocks' projections live on the
    (dp, tp) mesh, the rest on dp's), and sum them in an order that may differ between ranks. Under
    pipeline parallelism the stages hold different parameters: the same all-reduce over the world adds
    them up, each counted by the copies within its stage (``pipeline`` stages).
    """
    if not any(hasattr(g, "to_local") for g in grads):
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0).to(torch.float64)
    device = grads[0].device
    if device.type == "cpu" and dist.get_backend() == "nccl":  # FSDP2 CPU offload keeps gradients in host memory
        device = torch.device("cuda", torch.cuda.current_device())
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        by_copies.setdefault(parallel.copies(g, pipeline), []).append(g.to_local() if hasattr(g, "to_local") else g)
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for copies, local in by_copies.items():  # one fused norm per group (torch's foreach kernels)
        squares += torch.nn.utils.get_total_norm(local, norm_type=2.0).to(device, torch.float64).square() / copies
    dist.all_reduce(squares)
    return squares.sqrt()


def clip_gradients(model: nn.Module, max_norm: float, pipeline: int = 1) -> torch.Tensor:
    """Clip the global gradient norm to ``max_norm``; returns the norm before clipping (one reduction for
    the norm, then an in-place scale of the local gradients by min(1, max_norm / norm), computed on the
    device: scaling by 1 changes nothing, and no host decision waits for the norm)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norm = grad_norm(grads, pipeline)
    _scale(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


@torch.no_grad()
def _scale(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """grads *= coef in place: one foreach kernel per device and dtype, DTensors through their local shards."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g
        groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), tensors in groups.items():
        torch._foreach_mul_(tensors, coef.to(device, dtype))


# --------------------------------------------------------------------------- DDP and FSDP2


def fsdp_sync(fsdp: FSDPSpec | None, replicas: int, last: bool) -> dict[str, bool]:
    """FSDP2's gradient-sync switches for one micro-batch's backward (``last``: the step's last). By default every
    micro-batch reduce-scatters, so gradients accumulate sharded (1/shard of the model's per process); HSDP
    all-reduces the sharded sums across its ``replicas`` groups once, after the last. fsdp.accumulateUnsharded
    keeps whole gradients until the last micro-batch: one reduce-scatter a step, a whole gradient held."""
    if fsdp is not None and fsdp.accumulate_unsharded:
        return {"set_requires_gradient_sync": last}
    if replicas > 1:
        return {"set_requires_all_reduce": last}
    return {}


class TorchEngine(Engine):
    """DDP (``DistributedDataParallel``) or FSDP2 (``fully_shard`` per block + root), torch AMP."""

    def __init__(self, spec: TrainingJobSpec, model: nn.Module, device: torch.device, world_size: int) -> None:
        self.spec = spec
        self.device = device
        self.strategy = spec.strategy
        self.precision = spec.precision
        self.amp_dtype = AMP_DTYPES.get(spec.precision)
        self.pipeline: parallel.Pipeline | None = None
        self.replicas = 1
        if spec.strategy == "fsdp":
            layout = parallel.Layout.of(world_size, spec.parallelism)
            self.pipeline_degree, self.replicas = layout.pipeline, layout.replicate
            if layout.pipeline > 1:
                self.model, self.pipeline = parallel.parallelize_pipeline(model, spec, device, layout, self.amp_dtype)
            else:
                self.model = parallel.parallelize(model, spec, device, layout, self.amp_dtype)
        else:
            extra = compression.ddp_options(spec.ddp, model, device)
            self.model = parallel.replicate(model, spec, device, **extra)
        self.compression = (
            compression.attach(self.model, spec.ddp, spec.seed) if spec.strategy == "ddp" else None
        )
        # Without a comm hook DDP all-reduces every gradient once per step, in the parameters' dtype.
        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self.optimizer = make_optimizer(self.model.parameters(), spec)
        self.scheduler = make_scheduler(self.optimizer, spec)
        self.scaler: torch.amp.GradScaler | None = None
        if spec.precision == "fp16":
            if spec.strategy == "fsdp":
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: PLC0415

                self.scaler = ShardedGradScaler(device=device.type, init_scale=_fp16_init_scale())
            else:
                self.scaler = torch.amp.GradScaler(device.type, init_scale=_fp16_init_scale())

    def _sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Gradient synchronisation of one micro-batch's backward (``last``: the step's last one)."""
        if self.strategy == "fsdp":
            for switch, value in fsdp_sync(self.spec.fsdp, self.replicas, last).items():
                getattr(self.model, switch)(value)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.model.no_sync()  # type: ignore[operator]

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # FSDP2 casts through its MixedPrecisionPolicy; DDP uses autocast.
        if self.strategy == "ddp" and self.amp_dtype is not None:
            return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)
        return contextlib.nullcontext()

    @property
    def loss_weight(self) -> float:
        return 1.0 if self.pipeline is None or self.pipeline.is_last else 0.0

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if self.pipeline is not None:  # the schedule syncs FSDP2's gradients on each stage's last backward
            return self.pipeline.train_step(micro_batches)
        n = len(micro_batches)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._sync(i == n - 1):
                with self._autocast():
                    loss = self.model(x, y)
                scaled = loss / n
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            total += loss.detach().float()
        return total / n

    def eval_loss(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if self.pipeline is not None:
            return self.pipeline.eval_loss(micro_batches)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        with torch.no_grad(), self._autocast():
            for x, y in micro_batches:
                total += self.model(x.to(self.device), y.to(self.device)).float()
        return total / len(micro_batches)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def optimizer_step(self) -> StepInfo:
        clip = self.spec.optimizer.grad_clip
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.model, clip, self.pipeline_degree) if clip > 0 else None
        skipped = False
        scale: float | None = None
        if self.scaler is not None:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            scale = self.scaler.get_scale()
            skipped = scale < before
        else:
            self.optimizer.step()
        if not skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepInfo(grad_norm=grad_norm, skipped=skipped, loss_scale=scale, allreduce_bytes=self._allreduce_bytes())

    def _allreduce_bytes(self) -> int | None:
        if self.strategy != "ddp":
            return None
        return self.compression.take_bytes() if self.compression is not None else self.grad_bytes

    # -- checkpoints: torch.distributed.checkpoint, resharded on load

    def local_state(self) -> LocalState:
        return self

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        dcp.save(self._state(), checkpoint_id=str(path / "dcp"))
        self._save_small(path)

    def save_async(self, path: Path, writer: StateWriter) -> Future[Any]:
        """Stage the model/optimizer state into CPU memory and write it to ``path/dcp`` in the background
        (the future); the small parts (scheduler, scaler, compression state) are written now, first: where
        ``path`` is gone (a newer gang pruned a stale gang's save) the save fails before any write runs on in
        the background, which would create the directory again."""
        self._save_small(path)
        return writer.write(self._state(), path / "dcp")

    def _save_small(self, path: Path) -> None:
        if dist.get_rank() == 0:
            extra = {"scheduler": self.scheduler.state_dict()}
            if self.scaler is not None:
                extra["scaler"] = self.scaler.state_dict()
            torch.save(extra, path / "engine.pt")
        if self.compression is not None:
            self.compression.save(path)

    def load(self, path: Path, saved_world_size: int) -> None:
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415
        from torch.distributed.checkpoint.state_dict import set_state_dict  # noqa: PLC0415

        if not (path / "dcp").is_dir():
            raise ConfigError("strategy", f"checkpoint {path} was not written by strategy ddp/fsdp (no dcp/ directory)")
        state = self._state()
        own = [group["params"] for group in state["optim"]["param_groups"]]
        if legacy.is_fused(path / "dcp"):
            legacy.load_fused(state, path / "dcp")
        else:
            dcp.load(state, checkpoint_id=str(path / "dcp"))
        # DCP keeps one rank's copy of non-tensor values: the optimizer's one group names that rank's
        # parameters, another stage's under pipeline parallelism. The names only map the saved group's
        # hyperparameters (the same on every rank) onto this rank's group: keep this rank's own.
        for group, names in zip(state["optim"]["param_groups"], own, strict=True):
            group["params"] = names
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = safe_load(path / "engine.pt")
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.scaler is not None and "scaler" in extra:
            self.scaler.load_state_dict(extra["scaler"])
        if self.compression is not None:
            self.compression.load(path)


# --------------------------------------------------------------------------- DeepSpeed


def deepspeed_config(spec: TrainingJobSpec, world_size: int, model: nn.Module | None = None) -> dict[str, Any]:
    """The generated DeepSpeed config (docs/trainer.md#the-generated-deepspeed-config), in three layers:
    kubetrain's tuning defaults (ZeRO-3's from ``model`` and ``world_size``: parallel/zero3.py), then
    spec.deepspeed.config over them, then what the spec's own fields fix (batch sizes, clipping, precision,
    ZeRO stage, offload) over both: a user tunes any DeepSpeed key but cannot contradict the spec."""
    ds = spec.deepspeed
    stage = ds.zero_stage if ds else 2
    zero: dict[str, Any] = {"stage": stage}
    if ds and ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds and ds.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    defaults: dict[str, Any] = {
        "steps_per_print": 2**31 - 1,  # the trainer logs each step itself
        "wall_clock_breakdown": False,  # no per-phase timers and their log lines: the trainer times steps itself
    }
    if stage == 3:
        facts = zero3.model_facts(model) if model is not None else None
        defaults["zero_optimization"] = zero3.zero3_defaults(facts, world_size, bool(ds and ds.offload_param))
    ours: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "train_batch_size": spec.micro_batch_size * spec.gradient_accumulation_steps * world_size,
        "gradient_clipping": spec.optimizer.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": spec.precision == "bf16"},
        "fp16": {
            "enabled": spec.precision == "fp16",
            "initial_scale_power": int(torch.log2(torch.tensor(_fp16_init_scale())).item()),
        },
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    user = copy.deepcopy(ds.config) if ds and ds.config else {}
    return _merge(_merge(defaults, user), ours)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over``'s keys win; a dict under the same key in both is merged one level down (zero_optimization)."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _deepspeed_model(model: nn.Module, spec: TrainingJobSpec, device: torch.device,
                     config: dict[str, Any]) -> nn.Module:
    """``model`` with storage on ``device``. Built on the meta device, ZeRO-3 builds it again under
    ``deepspeed.zero.Init`` (each module's parameters partitioned as soon as it is built) and fills each parameter
    gathered, one at a time; ZeRO 0-2 keep whole parameters on every rank anyway."""
    if not parallel.on_meta(model):
        return model.to(device)
    if config["zero_optimization"]["stage"] != 3 or not isinstance(model, Transformer | HFCausalLM):
        return parallel.materialize(model, spec, device)
    import deepspeed  # noqa: PLC0415

    # zero.Init reads the world size from deepspeed.comm, which wraps the existing process group once told to.
    deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False,
                                    dist_init_required=False)
    # The engine's own dtype: deepspeed.initialize casts no model built under zero.Init, so an fp32 build of a
    # bf16 job would train in fp32 (8.6x slower on an H200). The fp32 master copy is the optimizer's.
    dtype = AMP_DTYPES.get(spec.precision, torch.float32)
    init = deepspeed.zero.Init(config_dict_or_path=config, remote_device=None, dtype=dtype)
    # DeepSpeed 0.19's Init reads an explicit dtype as `dtype or fp16 if fp16_supported() else bf16`: on a CPU
    # without fp16 kernels (no AVX512-FP16 or AMX) an fp32 asked for becomes bf16. Say it once more.
    init.dtype = dtype
    if isinstance(model, HFCausalLM):
        return _zero3_hf_model(spec, init)
    with init:
        built = Transformer(spec.model, spec.activation_checkpointing, seed=None)
    for name, p in built.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:
                generator = param_generator(spec.seed, name, p.device)
                p.copy_(initial_value(name, p.shape, spec.model.n_layers, generator, p.device))
    return built


def _zero3_hf_model(spec: TrainingJobSpec, init: contextlib.AbstractContextManager[Any]) -> nn.Module:
    """model.hfPath's model built under ``init`` (zero.Init) and loaded one parameter at a time: gathered whole
    on every rank, filled on rank 0 from the checkpoint (read one tensor at a time, in its dtype), and broadcast
    and partitioned again by DeepSpeed on leaving; persistent buffers (whole on every rank) are broadcast.
    spec.lora's adapters are added after the build, whole on every rank (small), seeded alike everywhere with no
    gather, and partitioned by ``deepspeed.initialize`` like any parameter zero.Init did not build (lora.py)."""
    import deepspeed  # noqa: PLC0415

    built = empty_hf_model(spec.model, spec.activation_checkpointing, init=init)
    if spec.lora is not None:
        apply_lora(built, spec.lora)
        # ZeRO-3 reduces the gradients of a block fetched as one unit (zero3.py) in the block's backward hook, which
        # fires after them only where the block's input requires grad (else backward failed: the frozen embeddings'
        # output does not): make it (peft does the same under activation checkpointing).
        hf_module(built).enable_input_require_grads()
    path = hf_dir(spec.model)
    read = hf_reader(path, hf_files(built, path)) if dist.get_rank() == 0 else None
    with torch.no_grad():
        for name, t in hf_targets(built).items():
            if not isinstance(t, nn.Parameter):
                if read is not None:
                    t.copy_(read(name))
                dist.broadcast(t, 0)
                continue
            with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                if read is not None:
                    t.copy_(read(name))
    recompute_buffers(built)
    init_adapters(built, spec.seed)
    return built


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO 0-3 with a torch AdamW (no JIT-compiled DeepSpeed Adam)."""

    TAG = "deepspeed"

    def __init__(self, spec: TrainingJobSpec, model: nn.Module, device: torch.device, world_size: int) -> None:
        import deepspeed  # noqa: PLC0415

        if device.type == "cpu" and os.environ.get(DEEPSPEED_SHM_ENV) != "1":
            # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op when its comm
            # backend starts (minutes on a small machine); it only serves inference all-reduce.
            # (`deepspeed.comm.torch` as an attribute is the torch package itself: go through sys.modules.)
            importlib.import_module("deepspeed.comm.torch")
            comm_torch: Any = sys.modules["deepspeed.comm.torch"]
            comm_torch.build_shm_op = lambda: None
        os.environ.setdefault("LOCAL_RANK", str(max(device.index or 0, 0)))  # DeepSpeed asserts it is set
        self.spec = spec
        self.device = device
        self.world_size = world_size
        self.zero_stage = spec.deepspeed.zero_stage if spec.deepspeed else 2
        config = deepspeed_config(spec, world_size, model)
        model = _deepspeed_model(model, spec, device, config)
        if spec.compile:  # before ZeRO wraps the model, as FSDP2 after it (its parameter hooks run eager)
            parallel.compile_blocks(model)
        optimizer = make_optimizer(model.parameters(), spec)
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lambda opt: make_scheduler(opt, spec),
            config=config,
            dist_init_required=False,
        )
        self.engine = engine
        self.model = engine.module

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        n = len(micro_batches)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        self._skipped_before = int(self.engine.skipped_steps)
        for x, y in micro_batches:
            loss = self.engine(x.to(self.device), y.to(self.device))
            self.engine.backward(loss)
            self.engine.step()  # an optimizer step only at the accumulation boundary
            total += loss.detach().float()
        return total / n

    def eval_loss(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        with torch.no_grad():  # the DeepSpeed engine's forward gathers ZeRO-3 parameters as in training
            for x, y in micro_batches:
                total += self.engine(x.to(self.device), y.to(self.device)).float()
        return total / len(micro_batches)

    def optimizer_step(self) -> StepInfo:
        norm = self.engine.get_global_grad_norm()
        skipped = int(self.engine.skipped_steps) > self._skipped_before
        scale = None
        if self.spec.precision == "fp16":
            scale = float(getattr(self.engine.optimizer, "cur_scale", 0.0)) or None
        return StepInfo(grad_norm=norm, skipped=skipped, loss_scale=scale)  # read after the step's loss

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path), tag=self.TAG, save_latest=False)
        if dist.get_rank() == 0:
            (path / "deepspeed.json").write_text(
                json.dumps({"world_size": self.world_size, "zero_stage": self.zero_stage})
            )

    def load(self, path: Path, saved_world_size: int) -> None:
        if not (path / self.TAG).is_dir():
            raise ConfigError("strategy", f"checkpoint {path} was not written by strategy deepspeed")
        if saved_world_size != self.world_size and self.zero_stage > 0:
            raise ConfigError(
                "workers",
                f"DeepSpeed ZeRO-{self.zero_stage} checkpoint {path} was saved at world size {saved_world_size} "
                f"and cannot be resumed at world size {self.world_size}; resume with {saved_world_size} processes "
                "(or convert it to a universal checkpoint with DeepSpeed's ds_to_universal)",
            )
        # Unsafe: DeepSpeed 0.19.8 unpickles these files with torch.load(weights_only=False), and offers no option.
        try:
            load_path, _ = self.engine.load_checkpoint(
                str(path), tag=self.TAG, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        except RuntimeError as exc:
            # ZeRO's flat optimizer partitions follow the parameters' order, which the split changed: such a
            # checkpoint cannot be converted safely, so it is refused for good rather than retried.
            if legacy.FUSED in str(exc):
                raise ConfigError("image", f"DeepSpeed checkpoint {path} holds the built-in model with one fused "
                                  "attn.qkv projection, as trainers before tensor parallelism wrote it: resume it "
                                  "with the trainer image that wrote it (spec.image), or start afresh") from exc
            raise
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {path}")


def make_engine(spec: TrainingJobSpec, model: nn.Module, device: torch.device, world_size: int) -> Engine:
    if spec.strategy == "deepspeed":
        return DeepSpeedEngine(spec, model, device, world_size)
    return TorchEngine(spec, model, device, world_size)
