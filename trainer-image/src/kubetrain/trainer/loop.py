"""The training loop: set up, step, report, stop; resuming and saving are the CheckpointManager's."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, TypeAlias

import torch
import torch.distributed as dist

from kubetrain.core import contract, hangs, hardware, rendezvous
from kubetrain.core.api import MemoryReport, ResumeTier, TrainingJobSpec
from kubetrain.core.contract import SIGTERM_EXIT_CODE
from kubetrain.core.progress import CheckpointRecord, Progress, read_progress, write_progress
from kubetrain.trainer import lora, parallel, preflight
from kubetrain.trainer.checkpoint.background import writes_running
from kubetrain.trainer.checkpoint.directory import TrainerState, now_rfc3339
from kubetrain.trainer.checkpoint.fence import Fence
from kubetrain.trainer.checkpoint.manager import CheckpointManager
from kubetrain.trainer.checkpoint.memory import MemoryTier
from kubetrain.trainer.config import ConfigError, Env, checkpoint_dir
from kubetrain.trainer.data import chat
from kubetrain.trainer.data.stream import ShardStream, cache_dir, eval_text
from kubetrain.trainer.data.text import Sampler, eval_batches, load_corpus, split_eval
from kubetrain.trainer.model import build_model, flops_per_token, vocab_size
from kubetrain.trainer.observe import flight_recorder, nccl_watch
from kubetrain.trainer.observe import transport as nccl_transport
from kubetrain.trainer.observe.memory import PeakMemory, unmap_large_frees
from kubetrain.trainer.observe.metrics import Metrics, peak_flops, uses_tf32
from kubetrain.trainer.observe.profiling import StepProfiler
from kubetrain.trainer.observe.progress import PodProgressReporter
from kubetrain.trainer.observe.tensorboard import ScalarWriter
from kubetrain.trainer.parallel.engines import Engine, StepInfo, make_engine

log = logging.getLogger("kubetrain.trainer")

LOSSES_FILE = "losses.jsonl"
"""One JSON line per optimizer step, written by rank 0 to the output dir (all generations appended)."""
PARAM_NORM_ENV = "KUBETRAIN_DEBUG_PARAM_NORM"
"""When "1", every losses.jsonl line carries the global parameter norm (tests)."""
PROGRESS_INTERVAL_SECONDS = 1.0

NCCL_PASSTHROUGH = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL", "NCCL_DEBUG")


class StopFlag:
    """Set by SIGTERM/SIGINT once training has begun; acted on at the next step boundary by all ranks
    together. Before that the signals keep their default action: a rank still joining the gang, running
    preflight or loading its checkpoint holds nothing to save, and may be blocked in a C++ call (a
    rendezvous with a peer that is gone) where a Python handler would never run until a timeout."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal is None:
            log.info("received %s; stopping at the next step boundary", signal.Signals(signum).name)
        self.signal = signum

    @property
    def set(self) -> bool:
        return self.signal is not None


def pick_device(env: Env) -> torch.device:
    if torch.cuda.is_available() and os.environ.get("KUBETRAIN_DEVICE", "") != "cpu":
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_distributed(env: Env, device: torch.device) -> Path | None:
    """Join the gang; under NCCL, the file NCCL logs its network choice to (nccl_transport.prepare)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    nccl_log = None
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        fabric = {k: os.environ[k] for k in NCCL_PASSTHROUGH if k in os.environ}
        if env.rank == 0 and fabric:
            log.info("NCCL fabric env: %s", fabric)
        nccl_log = nccl_transport.prepare(env.rank, env.output_dir, os.environ)
    flight_recorder.prepare_env(os.environ)
    rendezvous.await_master(os.environ)  # on another worker: polled, not left to torch's growing backoff
    master = rendezvous.store_address(os.environ) or env.master_addr  # never a lookup a new pod would wait on
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{f'[{master}]' if ':' in master else master}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=env.dist_timeout,
        device_id=device if device.type == "cuda" else None,
    )
    flight_recorder.watch_requests(env.rank)
    if backend == "nccl":
        nccl_watch.start(env.rank)  # a collective that failed exits PEER_LOST_EXIT_CODE, not NCCL's abort
    return nccl_log


def network_transport(env: Env, spec: TrainingJobSpec, device: torch.device, nccl_log: Path | None) -> str | None:
    """The transport the gang talks over, on rank 0 (None elsewhere): see nccl_transport.detect."""
    def first_collective() -> None:
        dist.all_reduce(torch.ones(1, device=device))
        torch.cuda.synchronize(device)

    local = int(os.environ.get(contract.LOCAL_WORLD_SIZE) or env.world_size)
    return nccl_transport.detect(
        rank=env.rank, multi_node=local < env.world_size, nccl=device.type == "cuda", log_file=nccl_log,
        fabric=spec.fabric, first_collective=first_collective,
    )


def scalars(record: dict[str, Any], rates: Rates) -> dict[str, float | None]:
    """One step's TensorBoard scalars."""
    return {
        "train/loss": record["loss"], "train/lr": record.get("lr"), "train/grad_norm": record.get("grad_norm"),
        "train/tokens_per_second": record.get("tokens_per_second"), "train/mfu": rates.mfu,
        "train/loss_scale": record.get("loss_scale"), "eval/loss": record.get("eval_loss"),
    }


class Reporter:
    """Rank 0's stdout line, losses.jsonl, progress.json and (in a pod) the progress annotation."""

    def __init__(self, env: Env, spec: TrainingJobSpec, ckpt_root: Path) -> None:
        self.env = env
        self.spec = spec
        self.ckpt_root = ckpt_root
        self.out = env.output_dir
        self.enabled = env.rank == 0
        self.losses: IO[str] | None = None
        self.progress = Progress(
            job=env.job, generation=env.generation, max_steps=spec.max_steps, world_size=env.world_size
        )
        self.last_write = 0.0
        self.pod = PodProgressReporter.from_env() if self.enabled else None
        self.board = ScalarWriter(ckpt_root / contract.TENSORBOARD_DIR, env.generation) if self.enabled else None
        if self.enabled and self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            self.losses = (self.out / LOSSES_FILE).open("a")
            previous = read_progress(self.out)
            if previous is not None:
                self.progress.initial_loss = previous.initial_loss
                self.progress.checkpoints = list(previous.checkpoints)
                self.progress.last_checkpoint = previous.last_checkpoint
                self.progress.fetch = previous.fetch  # the fetch step's record (kubetrain.trainer.data.fetch) stays

    def step(self, record: dict[str, Any], state: TrainerState, rates: Rates, force: bool) -> None:
        if not self.enabled:
            return
        step, loss = record["step"], record["loss"]
        evaluated = f" eval {record['eval_loss']:.4f}" if "eval_loss" in record else ""
        print(f"step {step}/{self.spec.max_steps} loss {loss:.4f}{evaluated} tok/s {record['tokens_per_second']:.0f}",
              flush=True)
        if self.losses is not None:
            self.losses.write(json.dumps(record) + "\n")
            self.losses.flush()
        self.progress.step = step
        self.progress.loss = loss
        self.progress.initial_loss = state.initial_loss
        if self.board is not None:
            self.board.scalars(step, scalars(record, rates))
        if "eval_loss" in record:
            self.progress.eval_loss = record["eval_loss"]
        self.progress.tokens_per_second = rates.tokens_per_second
        self.progress.step_seconds = rates.step_seconds
        self.progress.mfu = rates.mfu
        self.write(force)

    def profile_request(self) -> str | None:
        """Rank 0's on-demand profile request: its pod's annotation, else the local run's request file."""
        if not self.enabled:
            return None
        if self.pod is not None and (asked := self.pod.annotations.get(contract.PROFILE_ANNOTATION)):
            return asked
        try:
            return (self.out / contract.PROFILE_REQUEST_FILE).read_text().strip() if self.out else None
        except OSError:
            return None

    def carried_state(self) -> TrainerState:
        """The trainer state before a checkpoint is loaded: what progress.json kept of earlier generations."""
        return TrainerState(
            world_size=self.env.world_size,
            strategy=self.spec.strategy,
            initial_loss=self.progress.initial_loss,
            checkpoints=list(self.progress.checkpoints),
        )

    def resumed(self, step: int, tier: ResumeTier) -> None:
        self.progress.resumed_from = step
        self.progress.resumed_tier = tier

    def memory(self, report: MemoryReport | None) -> None:
        """Every rank's peaks as gathered (None: not a report step); the notices said at resume stay."""
        if report is not None:
            notices = self.progress.memory.notices if self.progress.memory is not None else []
            self.progress.memory = report.model_copy(update={"notices": notices})

    def memory_notices(self, notices: list[str]) -> None:
        """What the pods' memory cannot hold of the checkpoints (CheckpointManager.resume, rank 0)."""
        report = self.progress.memory or MemoryReport(generation=self.env.generation)
        self.progress.memory = report.model_copy(update={"notices": list(notices)})

    def started(self, step: int) -> None:
        """Out at once: the step this generation starts from."""
        self.progress.step = step
        self.write(True)

    def finish(self, step: int) -> None:
        """The last record: training reached maxSteps."""
        self.progress.finished = True
        self.progress.step = step
        self.write(True)
        self.close()

    def checkpoint(self, state: TrainerState, path: Path | str, seconds: float) -> None:
        if not self.enabled:
            return
        self.progress.last_checkpoint = CheckpointRecord(
            step=state.step, path=str(path), time=now_rfc3339(), seconds=seconds
        )
        self.progress.checkpoints = list(state.checkpoints)
        self.progress.best_eval_step = (state.best_eval or {}).get("step")
        self.write(True)

    def write(self, force: bool = False) -> None:
        """progress.json at most once a second (always when forced); the pod annotation gets the same
        record (its reporter sends at most every 10 s, forced ones at once, never blocking)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self.last_write < PROGRESS_INTERVAL_SECONDS:
            return
        self.progress.time = now_rfc3339()
        if self.out is not None:
            write_progress(self.out, self.progress)
        if self.pod is not None:
            self.pod.report(self.progress, force)
        self.last_write = now

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """Training ended by an error (a peer went away): the last step out before the process exits, since
        steps since the last record were trained and the restart trains them again (the goodput's stepsLost)."""
        if kind is not None:
            with contextlib.suppress(OSError):  # the training error is the one to report
                self.write(True)
        self.close()

    def close(self) -> None:
        if self.losses is not None:
            self.losses.close()
            self.losses = None
        if self.pod is not None:
            self.pod.close()  # the last record (finished, or the SIGTERM checkpoint) goes out now, bounded wait
            self.pod = None
        if self.board is not None:
            self.board.close()
            self.board = None


def _global_param_norm(engine: Engine) -> float:
    t = torch.tensor([engine.local_param_sq_norm()], dtype=torch.float64)
    if engine.spec.strategy == "fsdp":
        dist.all_reduce(t)  # shards add up; ddp/deepspeed ranks hold the full (replicated or gathered) view
    return float(t.sqrt())


@dataclass(frozen=True)
class Rates:
    tokens_per_second: float
    step_seconds: float | None
    mfu: float | None


class StepObserver:
    """Turns each finished step into its Prometheus metrics and its losses.jsonl record."""

    def __init__(
        self, env: Env, spec: TrainingJobSpec, engine: Engine, metrics: Metrics, fpt: float, peak: float | None
    ) -> None:
        self.env = env
        self.spec = spec
        self.engine = engine
        self.metrics = metrics
        self.flops_per_token = fpt
        self.peak = peak
        self.tokens_per_step = global_batch(spec, layout_of(env, spec).data) * spec.model.seq_len
        self.debug_norm = os.environ.get(PARAM_NORM_ENV) == "1"
        self.total_tokens = 0
        self.total_seconds = 0.0

    @property
    def mean_tokens_per_second(self) -> float:
        """Over the steps of this generation so far."""
        return self.total_tokens / self.total_seconds

    def rates(self) -> Rates:
        """Means over the steps of this generation so far, for rank 0's progress record."""
        steps = self.total_tokens // self.tokens_per_step
        tps = self.mean_tokens_per_second
        mfu = self.flops_per_token * tps / self.env.world_size / self.peak if self.peak else None
        return Rates(tps, self.total_seconds / steps if steps else None, mfu)

    def observe(self, state: TrainerState, loss: float, lr: float, info: StepInfo, seconds: float) -> dict[str, Any]:
        """Collective when the parameter norm is asked for (FSDP sums it over shards)."""
        self.total_tokens += self.tokens_per_step
        self.total_seconds += seconds
        tps = self.tokens_per_step / seconds if seconds > 0 else 0.0
        mfu = self.flops_per_token * tps / self.env.world_size / self.peak if self.peak else None
        if state.initial_loss is None:
            state.initial_loss = loss
        self.metrics.observe_step(state.step, loss, tps, seconds, mfu, info.skipped)
        record: dict[str, Any] = {
            "step": state.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": None if info.grad_norm is None else float(info.grad_norm),  # after the loss's wait
            "tokens_per_second": tps,
            "step_seconds": seconds,
            "generation": self.env.generation,
            "world_size": self.env.world_size,
            "time": time.time(),
            "cpu_time": time.process_time(),
        }
        if self.spec.precision == "fp16":
            record["loss_scale"] = info.loss_scale
            record["skipped"] = info.skipped
        if info.allreduce_bytes is not None:
            self.metrics.observe_allreduce(info.allreduce_bytes)
            record["allreduce_bytes"] = info.allreduce_bytes
        if self.debug_norm:
            record["param_norm"] = _global_param_norm(self.engine)
        return record


def global_batch(spec: TrainingJobSpec, data_replicas: int) -> int:
    """Samples per optimizer step over all ranks: each data-parallel replica draws its own (the world size
    without tensor parallelism; the ranks of one tensor-parallel group share theirs)."""
    return spec.micro_batch_size * spec.gradient_accumulation_steps * data_replicas


def layout_of(env: Env, spec: TrainingJobSpec) -> parallel.Layout:
    """The gang's (pp, dp, tp) grid: the sampler reads the data-parallel rank and size from it."""
    return parallel.Layout.of(env.world_size, spec.parallelism)


def train_step(
    engine: Engine, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, float, StepInfo]:
    """One optimizer step: forward and backward over the accumulation micro-batches (the engine scales
    the loss for fp16 and syncs gradients on the last one), then clipping and the optimizer step.
    Returns this rank's mean loss, the learning rate the step used, and what the optimizer step did."""
    lr = engine.lr()  # read before the step advances the scheduler
    local_loss = engine.forward_backward(micro_batches)
    return local_loss, lr, engine.optimizer_step()


def inject_failure(env: Env, step: int) -> None:
    """KUBETRAIN_FAIL_AT: die like a lost node after `step` on one rank, in the first generation only."""
    if env.fail_at is not None and env.fail_at == (env.rank, step) and env.generation == 0:
        print(f"kubetrain.trainer: injected failure at step {step} on rank {env.rank}", file=sys.stderr, flush=True)
        os._exit(contract.FAIL_AT_EXIT_CODE)


def weighted_mean(local: torch.Tensor, weight: float, device: torch.device, *extra: float) -> list[float]:
    """Collective: the mean of every rank's ``local`` weighed by its ``weight`` (1, or 0 on a pipeline stage
    that computes no loss), then the sums over ranks of ``extra`` (in the same all-reduce). On a GPU the one
    device-to-host wait is the result's (the step's loss): the host values go up without a stream sync."""
    red = torch.tensor([weight, *extra], dtype=torch.float64).to(device, non_blocking=True)
    red = torch.cat([(local.to(device, torch.float64) * weight).reshape(1), red])
    dist.all_reduce(red)
    total, weights, *sums = red.tolist()
    # Under tensor parallelism the T ranks of a group hold the same loss: the mean over all is still theirs.
    return [total / weights, *sums]


def mean_loss_and_stop(
    local_loss: torch.Tensor, stop_requested: bool, device: torch.device, weight: float = 1.0, write_done: bool = False
) -> tuple[float, bool, int]:
    """One collective per step: the mean loss over the ranks that computed one (``weight``), whether any rank
    was asked to stop, and how many ranks' background checkpoint write has finished (``write_done``;
    CheckpointManager.after_step commits when all have: this all-reduce is the agreement, so committing
    costs no collective of its own)."""
    loss, stops, done = weighted_mean(local_loss, weight, device, float(stop_requested), float(write_done))
    return loss, stops > 0, round(done)


def train(env: Env, spec: TrainingJobSpec) -> int:
    stop = StopFlag()
    hangs.write_beat(0, hangs.START, force=True)  # from here its supervisor watches this rank
    ckpt_root = checkpoint_dir(spec, env)
    data, held = open_data(env, spec)  # config errors before the gang
    with contextlib.closing(data):  # data.uri's prefetch thread stops
        device = pick_device(env)
        if uses_tf32(device.type, spec.precision):  # fp32 matmuls on TF32 tensor cores; MFU's peak is TF32's
            torch.set_float32_matmul_precision("high")
        nccl_log = init_distributed(env, device)
        try:
            transport = network_transport(env, spec, device, nccl_log)
            return _train(env, spec, stop, ckpt_root, data, device, transport, held)
        finally:
            # Destroying the groups under a running background checkpoint write would wait for its collective
            # (gloo joins its threads): the process exits without, and the write is never committed.
            if dist.is_initialized() and not writes_running():
                dist.destroy_process_group()


Data: TypeAlias = Sampler | ShardStream | chat.ChatSampler
Held: TypeAlias = torch.Tensor | chat.Samples
"""The evaluation data: text, or chat/instruction samples (data.format)."""


def open_data(env: Env, spec: TrainingJobSpec) -> tuple[Data, Held | None]:
    """The training batches and the evaluation text: data.path's text in memory, data.uri's shards streamed
    through this rank's cache (listed and checked here, before the gang forms), or data.format's samples
    (data.uri's fetched into the cache before: fetch.resolved made it data.path)."""
    if spec.data.format != "text":
        return chat.open_samples(spec)
    if spec.data.uri is None:
        corpus, held = split_eval(load_corpus(spec.data, spec.model.seq_len), spec)
        return Sampler(corpus, spec.model.seq_len, spec.seed), held
    held = eval_text(spec)
    layout = layout_of(env, spec)
    directory = cache_dir(env.output_dir, env.rank)
    return ShardStream.open(spec, layout.data, layout.data_rank(env.rank), directory), held


def _bf16_notice(env: Env, spec: TrainingJobSpec, device: torch.device) -> None:
    """Rank 0 says so before the first step when bf16 is slower than fp32 on this CPU (a pod's log)."""
    if env.rank == 0 and device.type == "cpu" and spec.precision == "bf16":
        notice = hardware.bf16_notice(hardware.bf16_slowdown(), hardware.this_cpu_native_bf16())
        if notice:
            log.warning("%s", notice)


def _compile_notice(env: Env, spec: TrainingJobSpec, first_step_seconds: float | None = None) -> None:
    """Rank 0 says (a pod's log) that spec.compile is on before the first step, which compiles every block,
    and then how long that step took: the price of compiling, which every generation pays (less where Inductor's
    on-disk cache survived the restart, as in a restart in place)."""
    if env.rank != 0 or not spec.compile:
        return
    if first_step_seconds is None:
        log.info("compile: torch.compile of every transformer block; the first step compiles them (slow)")
        return
    from torch._dynamo.utils import counters  # noqa: PLC0415 - Dynamo's own tally of what it compiled

    # The blocks are alike, so one graph serves them all: more means graph breaks or recompilations.
    graphs = counters["stats"]["unique_graphs"]
    log.info("compile: the first step took %.1f s, compilation included (%d graph(s) compiled)",
             first_step_seconds, graphs)


def check_vocab(data: Data, held: Held | None, vocab: int) -> None:
    """Every token id must be one the model embeds (a tokenizer bigger than the model's vocabulary); data.uri's
    shards are checked batch by batch as they are read."""
    if isinstance(data, ShardStream):
        data.vocab = vocab
    top = max(_top_id(data), _top_id(held))
    if top >= vocab:
        raise ConfigError("data.tokenizer", f"the tokenizer produced id {top}, but the model's vocabulary holds "
                          f"{vocab} ids: set model.vocabSize (built-in model) or use the hfPath model's own tokenizer")


def _top_id(data: Data | Held | None) -> int:
    """The largest token id data holds in memory (0: none, or streamed)."""
    if isinstance(data, Sampler):
        return int(data.corpus.max())
    if isinstance(data, chat.ChatSampler):
        return data.samples.max_id()
    if isinstance(data, chat.Samples):
        return data.max_id()
    return int(data.max()) if isinstance(data, torch.Tensor) else 0


class Evaluator:
    """evalEverySteps: the loss on the fixed held-out windows, averaged over the ranks that compute one (all,
    or a pipeline's last stage; a collective)."""

    def __init__(self, env: Env, spec: TrainingJobSpec, engine: Engine, held: Held | None,
                 device: torch.device, metrics: Metrics) -> None:
        self.env, self.spec, self.engine, self.device, self.metrics = env, spec, engine, device, metrics
        layout = layout_of(env, spec)
        batches = eval_batches if isinstance(held, torch.Tensor) else chat.eval_batches
        self.batches = batches(held, spec, layout.data, layout.data_rank(env.rank)) if held is not None else None

    def after_step(self, state: TrainerState, record: dict[str, Any], final: bool) -> None:
        every = self.spec.eval_every_steps
        if self.batches is None or every is None or not (final or state.step % every == 0):
            return
        hangs.write_beat(state.step, hangs.EVAL, force=True)
        local = self.engine.eval_loss(self.batches)
        state.eval_loss, state.eval_step = weighted_mean(local, self.engine.loss_weight, self.device)[0], state.step
        record["eval_loss"] = state.eval_loss
        self.metrics.set_eval_loss(state.eval_loss)
        if self.env.rank == 0:
            log.info("step %d eval loss %.4f", state.step, state.eval_loss)


def export_if_asked(env: Env, spec: TrainingJobSpec, ckpt_root: Path, step: int, reporter: Reporter) -> None:
    """spec.export, on rank 0 once the final checkpoint is committed (the other ranks exit meanwhile): where it
    went goes into the last progress record."""
    if spec.export is None or not spec.export.hugging_face or env.rank != 0:
        return
    # Judged as a start, not as a step: the export (minutes for a large model) may take up to startSeconds.
    hangs.write_beat(step, hangs.START, force=True)
    from kubetrain.trainer.export import export_at_success  # noqa: PLC0415 - transformers, peft: export jobs only

    reporter.progress.export = export_at_success(spec, ckpt_root, step)


def _train(
    env: Env, spec: TrainingJobSpec, stop: StopFlag, ckpt_root: Path, data: Data, device: torch.device,
    transport: str | None = None, held: Held | None = None,
) -> int:
    metrics = Metrics(env.job, env.rank, env.metrics_port, addr=env.metrics_addr)
    metrics.set_generation(env.generation)
    checked = preflight.run(env, spec, device, metrics)  # collective, before the model: no step yet
    model = build_model(spec.model, spec.activation_checkpointing, spec.seed, meta=True)  # storage once sharded
    unmap_large_frees(sum(p.numel() for p in model.parameters()))  # before its storage: freed buffers must go
    lora.add_adapters(model, spec.lora, announce=env.rank == 0)  # spec.lora's, before the engine shards
    check_vocab(data, held, vocab_size(model))
    fpt = flops_per_token(model, spec.model)
    engine = make_engine(spec, model, device, env.world_size)
    with Reporter(env, spec, ckpt_root) as reporter, contextlib.ExitStack() as exits:
        reporter.progress.network_transport = transport
        reporter.progress.preflight = checked
        _bf16_notice(env, spec, device)
        _compile_notice(env, spec)
        memory = MemoryTier.from_env(os.environ, spec, engine, env.rank, env.world_size)
        checkpoints = CheckpointManager(ckpt_root, spec.checkpoint, engine, metrics, reporter, memory=memory,
                                        timeout=env.dist_timeout,
                                        fence_id=Fence(env.run, env.generation) if env.run else None)
        exits.callback(checkpoints.close)
        state = checkpoints.resume(reporter.carried_state())
        reporter.started(state.step)
        observer = StepObserver(env, spec, engine, metrics, fpt, peak_flops(device, spec.precision))
        evaluator = Evaluator(env, spec, engine, held, device, metrics)
        peaks = PeakMemory.of_rank(env.rank, env.generation, device, metrics)
        profiler = StepProfiler(spec, env.rank, ckpt_root, device, reporter.profile_request)
        mbs, ga = spec.micro_batch_size, spec.gradient_accumulation_steps
        layout = layout_of(env, spec)
        data_rank = layout.data_rank(env.rank)
        first = True
        stop.install()
        while state.step < spec.max_steps:
            t0 = time.perf_counter()
            profiler.before_step(state.step + 1)
            local_loss, lr, info = train_step(engine, data.micro_batches(state.step, mbs, ga, layout.data, data_rank))
            state.step += 1
            profiler.after_step(state.step)
            state.samples_seen += global_batch(spec, layout.data)
            inject_failure(env, state.step)
            loss, stopping, writes_done = mean_loss_and_stop(local_loss, stop.set, device, engine.loss_weight,
                                                             checkpoints.write_done())
            checkpoints.after_step(writes_done)
            hangs.write_beat(state.step)
            record = observer.observe(state, loss, lr, info, time.perf_counter() - t0)
            final = state.step >= spec.max_steps
            evaluator.after_step(state, record, final)
            due = checkpoints.due(state.step, final=final, stopping=stopping)
            reporter.memory(peaks.after_step(state.step, record, first=first, final=final, checkpoint=due))
            reporter.step(record, state, observer.rates(), force=first or final or due)
            if first:
                _compile_notice(env, spec, first_step_seconds=record["step_seconds"])
            first = False
            if due:
                hangs.write_beat(state.step, hangs.CHECKPOINT, force=True)
            checkpoints.maybe_save(state, final=final, stopping=stopping)
            if memory is not None:
                memory.maybe_save(state, final=final)
            if due:  # the stall is over (a background write goes on): judged as training again
                hangs.write_beat(state.step)
            if final:
                break
            if stopping:
                if env.rank == 0:
                    log.info("stopping at step %d after a termination signal", state.step)
                return SIGTERM_EXIT_CODE
        export_if_asked(env, spec, ckpt_root, state.step, reporter)
        reporter.finish(state.step)
        return 0
