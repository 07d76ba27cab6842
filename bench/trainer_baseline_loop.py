"""A minimal hand-written training loop: the yardstick for bench/trainer_throughput.py.

Same model (kubetrain.trainer.model.Transformer), same wrapping (DDP, or FSDP2
fully_shard per block + root), same AdamW, same micro batch, accumulation, precision
and gradient clipping as the trainer config it reads (KUBETRAIN_CONFIG), launched
with the same environment contract. No checkpoints, no metrics, no progress file:
just the work. Rank 0 prints one JSON line with tokens/s at the median step time
(wall clock between consecutive step ends, after the first steps).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.data.text import load_corpus
from kubetrain.trainer.model import Transformer

WARMUP_STEPS = int(os.environ.get("BENCH_WARMUP_STEPS", "3"))


def main() -> None:
    spec = TrainingJobSpec.model_validate(json.loads(Path(os.environ["KUBETRAIN_CONFIG"]).read_text()))
    if spec.strategy not in ("ddp", "fsdp"):
        raise SystemExit(f"the baseline loop has no {spec.strategy} path (ddp and fsdp only)")
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=ws,
        timeout=timedelta(seconds=120),
    )
    torch.manual_seed(spec.seed)
    model = Transformer(spec.model, spec.activation_checkpointing)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision)
    if spec.strategy == "fsdp":
        mesh = init_device_mesh("cpu", (ws,))
        mp = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32) if amp else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model)
    o = spec.optimizer
    opt = torch.optim.AdamW(wrapped.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    corpus = load_corpus(spec.data, spec.model.seq_len)
    mbs, ga, t = spec.micro_batch_size, spec.gradient_accumulation_steps, spec.model.seq_len
    gen = torch.Generator().manual_seed(spec.seed + rank)
    ends: list[float] = []
    cpu: list[float] = []
    for _step in range(spec.max_steps):
        for m in range(ga):
            idx = torch.randint(0, corpus.numel() - t - 1, (mbs,), generator=gen)[:, None] + torch.arange(t + 1)
            w = corpus[idx].long()
            last = m == ga - 1
            if spec.strategy == "fsdp":
                wrapped.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            else:
                sync = contextlib.nullcontext() if last else wrapped.no_sync()
            cast = torch.autocast("cpu", dtype=amp) if amp and spec.strategy == "ddp" else contextlib.nullcontext()
            with sync:
                with cast:
                    loss = wrapped(w[:, :-1], w[:, 1:])
                (loss / ga).backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
    dist.barrier()
    if rank == 0:
        steps = [b - a for a, b in zip(ends[WARMUP_STEPS - 1 :], ends[WARMUP_STEPS:], strict=False)]
        median = statistics.median(steps)
        cpu_median = statistics.median(b - a for a, b in zip(cpu[WARMUP_STEPS - 1 :], cpu[WARMUP_STEPS:], strict=False))
        result = {"tokens_per_second": mbs * ga * ws * t / median, "step_seconds": median, "cpu_seconds": cpu_median}
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
