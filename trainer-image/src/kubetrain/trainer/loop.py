"""The training loop: init, resume, step, checkpoint, report, stop."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import IO, Any

import torch
import torch.distributed as dist

from kubetrain.core import contract
from kubetrain.core.api import TrainingJobSpec
from kubetrain.core.progress import CheckpointRecord, Progress, latest_checkpoint, read_progress, write_progress
from kubetrain.trainer.checkpoint import TrainerState, load_checkpoint, now_rfc3339, save_checkpoint
from kubetrain.trainer.config import SIGTERM_EXIT_CODE, Env, checkpoint_dir
from kubetrain.trainer.data import Sampler, load_corpus
from kubetrain.trainer.engines import Engine, make_engine
from kubetrain.trainer.metrics import Metrics, peak_flops
from kubetrain.trainer.model import build_model, flops_per_token
from kubetrain.trainer.pod_progress import PodProgressReporter

log = logging.getLogger("kubetrain.trainer")

LOSSES_FILE = "losses.jsonl"
"""One JSON line per optimizer step, written by rank 0 to the output dir (all generations appended)."""
PARAM_NORM_ENV = "KUBETRAIN_DEBUG_PARAM_NORM"
"""When "1", every losses.jsonl line carries the global parameter norm (tests)."""
PROGRESS_INTERVAL_SECONDS = 1.0

NCCL_PASSTHROUGH = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL", "NCCL_DEBUG")


class StopFlag:
    """Set by SIGTERM/SIGINT; acted on at the next step boundary by all ranks together."""

    def __init__(self) -> None:
        self.signal: int | None = None

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


def init_distributed(env: Env, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        fabric = {k: os.environ[k] for k in NCCL_PASSTHROUGH if k in os.environ}
        if env.rank == 0 and fabric:
            log.info("NCCL fabric env: %s", fabric)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=env.dist_timeout,
        device_id=device if device.type == "cuda" else None,
    )


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
        if self.enabled and self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            self.losses = (self.out / LOSSES_FILE).open("a")
            previous = read_progress(self.out)
            if previous is not None:
                self.progress.initial_loss = previous.initial_loss
                self.progress.checkpoints = list(previous.checkpoints)
                self.progress.last_checkpoint = previous.last_checkpoint

    def step(self, record: dict[str, Any], state: TrainerState, tokens_per_second: float, force: bool) -> None:
        if not self.enabled:
            return
        step, loss = record["step"], record["loss"]
        print(f"step {step}/{self.spec.max_steps} loss {loss:.4f} tok/s {record['tokens_per_second']:.0f}", flush=True)
        if self.losses is not None:
            self.losses.write(json.dumps(record) + "\n")
            self.losses.flush()
        self.progress.step = step
        self.progress.loss = loss
        self.progress.initial_loss = state.initial_loss
        self.progress.tokens_per_second = tokens_per_second
        self.write(force)

    def checkpoint(self, state: TrainerState, path: Path, seconds: float) -> None:
        if not self.enabled:
            return
        self.progress.last_checkpoint = CheckpointRecord(
            step=state.step, path=str(path), time=now_rfc3339(), seconds=seconds
        )
        self.progress.checkpoints = list(state.checkpoints)
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

    def close(self) -> None:
        if self.losses is not None:
            self.losses.close()
            self.losses = None
        if self.pod is not None:
            self.pod.close()  # the last record (finished, or the SIGTERM checkpoint) goes out now, bounded wait
            self.pod = None


def _global_param_norm(engine: Engine) -> float:
    t = torch.tensor([engine.local_param_sq_norm()], dtype=torch.float64)
    if engine.spec.strategy == "fsdp":
        dist.all_reduce(t)  # shards add up; ddp/deepspeed ranks hold the full (replicated or gathered) view
    return float(t.sqrt())


def train(env: Env, spec: TrainingJobSpec) -> int:
    stop = StopFlag()
    stop.install()
    ckpt_root = checkpoint_dir(spec, env)
    corpus = load_corpus(spec.data, spec.model.seq_len)  # config errors before joining the gang
    device = pick_device(env)
    init_distributed(env, device)
    try:
        return _train(env, spec, stop, ckpt_root, corpus, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(
    env: Env, spec: TrainingJobSpec, stop: StopFlag, ckpt_root: Path, corpus: torch.Tensor, device: torch.device
) -> int:
    rank, ws = env.rank, env.world_size
    metrics = Metrics(env.job, rank, env.metrics_port)
    metrics.restart_generation.labels(**metrics.labels).set(env.generation)
    sampler = Sampler(corpus, spec.model.seq_len, spec.seed)
    model = build_model(spec.model, spec.activation_checkpointing, spec.seed)
    fpt = flops_per_token(model, spec.model)
    engine = make_engine(spec, model, device, ws)
    reporter = Reporter(env, spec, ckpt_root)
    state = TrainerState(world_size=ws, strategy=spec.strategy)
    state.initial_loss = reporter.progress.initial_loss
    state.checkpoints = list(reporter.progress.checkpoints)

    # Resume: rank 0 picks the newest committed checkpoint so that every rank loads the same one.
    found = [latest_checkpoint(ckpt_root) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        step, path = found[0]
        t0 = time.perf_counter()
        saved = load_checkpoint(Path(path), engine)
        seconds = time.perf_counter() - t0
        metrics.checkpoint_load_seconds.labels(**metrics.labels).set(seconds)
        if saved.world_size != ws:
            log.info("resharding checkpoint from world size %d to %d", saved.world_size, ws)
        state = TrainerState(
            step=saved.step,
            samples_seen=saved.samples_seen,
            world_size=ws,
            strategy=spec.strategy,
            initial_loss=saved.initial_loss if saved.initial_loss is not None else state.initial_loss,
            checkpoints=sorted(set(saved.checkpoints) | set(state.checkpoints)),
        )
        reporter.progress.resumed_from = step
        if rank == 0:
            log.info("resumed from %s (step %d) in %.2fs", path, step, seconds)
    reporter.progress.step = state.step
    reporter.write(True)

    mbs, ga = spec.micro_batch_size, spec.gradient_accumulation_steps
    global_batch = mbs * ga * ws
    tokens_per_step = global_batch * spec.model.seq_len
    peak = peak_flops(device, spec.precision)
    debug_norm = os.environ.get(PARAM_NORM_ENV) == "1"
    total_tokens, total_seconds = 0, 0.0
    first_step = True
    while state.step < spec.max_steps:
        t0 = time.perf_counter()
        micro = sampler.micro_batches(state.step, mbs, ga, ws, rank)
        lr = engine.lr()
        local_loss = engine.forward_backward(micro)
        info = engine.optimizer_step()
        state.step += 1
        state.samples_seen += global_batch
        if env.fail_at is not None and env.fail_at == (rank, state.step) and env.generation == 0:
            print(
                f"kubetrain.trainer: injected failure at step {state.step} on rank {rank}", file=sys.stderr, flush=True
            )
            os._exit(contract.FAIL_AT_EXIT_CODE)
        # One collective per step: the mean loss over ranks and whether any rank was asked to stop.
        red = torch.stack(
            [local_loss.to(torch.float64).cpu(), torch.tensor(1.0 if stop.set else 0.0, dtype=torch.float64)]
        )
        if device.type == "cuda":
            red = red.to(device)
        dist.all_reduce(red)
        loss = float(red[0]) / ws
        stopping = float(red[1]) > 0
        seconds = time.perf_counter() - t0
        total_tokens += tokens_per_step
        total_seconds += seconds
        tps = tokens_per_step / seconds if seconds > 0 else 0.0
        mfu = fpt * tps / ws / peak if peak else None
        if state.initial_loss is None:
            state.initial_loss = loss
        metrics.observe_step(state.step, loss, tps, seconds, mfu, info.skipped)
        record: dict[str, Any] = {
            "step": state.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": info.grad_norm,
            "tokens_per_second": tps,
            "step_seconds": seconds,
            "generation": env.generation,
            "world_size": ws,
            "time": time.time(),
            "cpu_time": time.process_time(),
        }
        if spec.precision == "fp16":
            record["loss_scale"] = info.loss_scale
            record["skipped"] = info.skipped
        if debug_norm:
            record["param_norm"] = _global_param_norm(engine)
        final = state.step >= spec.max_steps
        due = final or state.step % spec.checkpoint.every_steps == 0 or (stopping and spec.checkpoint.on_sigterm)
        reporter.step(record, state, total_tokens / total_seconds, force=first_step or final or due)
        first_step = False
        if due:
            t1 = time.perf_counter()
            state.checkpoints = sorted(set(state.checkpoints) | {state.step})
            # Ephemeral checkpoints sit in each pod's own directory: nothing to require of the others.
            path = save_checkpoint(ckpt_root, engine, state, spec.checkpoint.keep,
                                   shared=not spec.checkpoint.ephemeral)
            save_seconds = time.perf_counter() - t1
            metrics.checkpoint_save_seconds.labels(**metrics.labels).set(save_seconds)
            metrics.checkpoints.labels(**metrics.labels).inc()
            reporter.checkpoint(state, path, save_seconds)
            if rank == 0:
                log.info("checkpoint step %d committed in %.2fs: %s", state.step, save_seconds, path)
        if final:
            break
        if stopping:
            if rank == 0:
                log.info("stopping at step %d after a termination signal", state.step)
            reporter.close()
            return SIGTERM_EXIT_CODE
    reporter.progress.finished = True
    reporter.progress.step = state.step
    reporter.write(True)
    reporter.close()
    return 0
