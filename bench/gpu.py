"""GPU benchmark of kubetrain's trainer: throughput and MFU, all-reduce bandwidth, checkpoint stall.

    .venv/bin/python bench/gpu.py --out bench/results/gpu.json           # ~1B model, bf16, one GPU
    torchrun --nproc-per-node 8 bench/gpu.py --out gpu.json               # every GPU of a machine
    .venv/bin/python bench/gpu.py --tiny --out /tmp/gpu-tiny.json         # a few M parameters, CPU is fine
    .venv/bin/python bench/gpu.py --sections train --variants fsdp2 --d-model 4096 --heads 32 --layers 32 --ac \
        --micro-batch 1 --grad-accum 4 --compile off --out gpu-7b.json    # ~6.7B, built on the meta device

1. Tokens/s and MFU of kubetrain's trainer (FSDP2, DeepSpeed ZeRO-3; the model built on the meta device
   and materialised shard by shard, as the trainer does) against a hand-written loop over the same model
   built on the device (bench/gpu_train.py), eager and with torch.compile per block; per variant also
   its build time and the host's peak resident set.
2. all_reduce algbw / busbw over message sizes (bench/gpu_comm.py).
3. The training loop's stall for a synchronous and an asynchronous DCP checkpoint of the model
   and optimizer state (bench/gpu_ckpt.py).
Prints Markdown tables; --out writes every number as JSON (rank 0). Each measurement that fails
(out of memory, a missing package) is recorded as an error and the others still run; the exit
code is then 1. Never needs a GPU to import or to run --tiny (gloo on CPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import gpu_ckpt
import gpu_comm
import gpu_env
import gpu_model
import gpu_report
import gpu_train
import torch.distributed as dist

from kubetrain.core.contract import format_time

SECTIONS = ("train", "allreduce", "checkpoint")


@dataclass(frozen=True)
class Settings:
    shape: gpu_model.Shape
    timing: gpu_train.Timing
    variants: tuple[gpu_train.Variant, ...]
    sizes: list[int]
    allreduce_iters: int
    saves: int
    gap: int
    sections: tuple[str, ...]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a few M parameters, few steps, small messages (CPU: seconds)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--precision", choices=("bf16", "fp32"), help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s of one device (default: detected)")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="also run the torch.compile variants (auto: on CUDA only)")
    ap.add_argument("--micro-batch", type=int)
    ap.add_argument("--grad-accum", type=int)
    ap.add_argument("--layers", type=int, help="transformer blocks (default 18: ~1B parameters; --tiny 4)")
    ap.add_argument("--d-model", type=int, help="model width (default 2048; --tiny 256)")
    ap.add_argument("--heads", type=int, help="attention heads (default 16, of 128 with the default width; --tiny 4)")
    ap.add_argument("--ac", action="store_true", help="spec.activationCheckpointing: recompute each block in backward")
    ap.add_argument("--warmup", type=int, help="untimed steps per variant (default 3, --tiny 1)")
    ap.add_argument("--steps", type=int, help="timed steps per variant (default 10, --tiny 3)")
    ap.add_argument("--variants", help="comma list of " + ", ".join(v.name for v in gpu_train.VARIANTS))
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of " + ", ".join(SECTIONS))
    ap.add_argument("--ckpt-dir", type=Path, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--ckpt-saves", type=int, help="saves per mode (default 3, --tiny 2)")
    return ap.parse_args(argv)


def settings(args: argparse.Namespace, rt: gpu_env.Runtime) -> Settings:
    tiny = args.tiny
    base = gpu_model.TINY if tiny else gpu_model.FULL
    shape = replace(
        base,
        precision=args.precision or ("bf16" if rt.cuda else "fp32"),
        micro_batch=args.micro_batch or base.micro_batch,
        grad_accum=args.grad_accum or base.grad_accum,
        n_layers=args.layers or base.n_layers,
        d_model=args.d_model or base.d_model,
        n_heads=args.heads or base.n_heads,
        activation_checkpointing=args.ac,
    )
    compiled = args.compile == "on" or (args.compile == "auto" and rt.cuda)
    wanted = set(args.variants.split(",")) if args.variants else None
    unknown = (wanted or set()) - {v.name for v in gpu_train.VARIANTS}
    if unknown:
        raise SystemExit(f"unknown variants: {', '.join(sorted(unknown))}")
    variants = tuple(
        v for v in gpu_train.VARIANTS if (v.name in wanted if wanted else compiled or not v.compiled)
    )
    return Settings(
        shape=shape,
        timing=gpu_train.Timing(warmup=args.warmup or (1 if tiny else 3), steps=args.steps or (3 if tiny else 10)),
        variants=variants,
        sizes=gpu_comm.TINY_SIZES if tiny else gpu_comm.FULL_SIZES,
        allreduce_iters=5 if tiny else 20,
        saves=args.ckpt_saves or (2 if tiny else 3),
        gap=1 if tiny else 5,
        sections=sections(args.sections),
    )


def sections(raw: str) -> tuple[str, ...]:
    chosen = tuple(s for s in raw.split(",") if s)
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections: {', '.join(sorted(unknown))} (known: {', '.join(SECTIONS)})")
    return chosen


def guarded(rt: gpu_env.Runtime, what: str, fn: Any, *args: Any) -> dict[str, Any]:
    """Run one measurement; a failure becomes an ``error`` entry instead of ending the run."""
    try:
        return fn(rt, *args)
    except Exception as exc:  # noqa: BLE001 - one OOM or missing package must not lose the other numbers
        traceback.print_exc()
        print(f"bench/gpu.py: {what} failed: {exc}", file=sys.stderr, flush=True)
        error = f"{type(exc).__name__}: {exc}"[:2000]
    gpu_train.release(rt, True)  # out of the except block: the traceback no longer holds the model
    return {"error": error}


def run_train(rt: gpu_env.Runtime, s: Settings, peak: float | None, result: dict[str, Any], out: Path | None) -> None:
    """Every variant into result["train"]; the JSON is rewritten after each one."""
    variants: list[dict[str, Any]] = []
    result["train"] = {
        "precision": s.shape.precision,
        "micro_batch": s.shape.micro_batch,
        "grad_accum": s.shape.grad_accum,
        "world_size": rt.world_size,
        "tokens_per_step": s.shape.tokens_per_step(rt.world_size),
        "warmup": s.timing.warmup,
        "steps": s.timing.steps,
        "attention": gpu_model.attention_backend(s.shape, rt.device),
        "variants": variants,
    }
    for v in s.variants:
        print(f"bench/gpu.py: training {v.name} ...", file=sys.stderr, flush=True)
        r = guarded(rt, v.name, gpu_train.measure, s.shape, v, s.timing)
        if "tokens_per_second_per_gpu" in r:
            r["mfu"] = gpu_model.mfu(result["model"]["flops_per_token"], r["tokens_per_second_per_gpu"], peak)
        variants.append({"name": v.name, "loop": v.loop, "strategy": v.strategy, "compiled": v.compiled, **r})
        write(rt, out, result)


def shared_tmpdir(rt: gpu_env.Runtime, parent: Path | None) -> Path:
    """One directory for all ranks (DCP writes every rank's shard into the same checkpoint)."""
    made = [tempfile.mkdtemp(prefix="kt-gpu-ckpt-", dir=parent) if rt.rank == 0 else None]
    dist.broadcast_object_list(made, src=0, group=rt.cpu_group)
    return Path(str(made[0]))


def run_checkpoint(rt: gpu_env.Runtime, s: Settings, parent: Path | None) -> dict[str, Any]:
    root = shared_tmpdir(rt, parent)
    try:
        result = guarded(rt, "checkpoint", gpu_ckpt.measure, s.shape, s.saves, s.gap, root)
        return {**result, "filesystem": gpu_ckpt.filesystem(root)}
    finally:
        dist.barrier(group=rt.cpu_group)
        if rt.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        gpu_train.release(rt, False)


def run(args: argparse.Namespace, rt: gpu_env.Runtime) -> dict[str, Any]:
    s = settings(args, rt)
    peak, source = gpu_env.peak(rt, s.shape.precision, args.peak_tflops)
    result: dict[str, Any] = {
        "schema": "kubetrain-bench-gpu/1",
        "time": format_time(datetime.now(timezone.utc)),  # noqa: UP017 - as contract.py writes it
        "command": sys.argv,
        "tiny": args.tiny,
        "device": gpu_env.describe(rt),
        "peak_tflops": peak / 1e12 if peak else None,
        "peak_source": source,
        "model": gpu_model.describe(gpu_model.job_spec(s.shape, "fsdp", 1)),
    }
    if not rt.cuda:
        result["note"] = "CPU run, not a GPU result: it shows the code paths work, nothing about GPU speed"
    # DeepSpeed, the last training variant, leaves process-wide state behind: training runs last.
    if "allreduce" in s.sections:
        warmup = 2 if args.tiny else 5
        result["allreduce"] = guarded(rt, "allreduce", gpu_comm.measure, s.sizes, warmup, s.allreduce_iters)
        write(rt, args.out, result)
    if "checkpoint" in s.sections:
        result["checkpoint"] = run_checkpoint(rt, s, args.ckpt_dir)
        write(rt, args.out, result)
    if "train" in s.sections:
        run_train(rt, s, peak, result, args.out)
    result["targets"] = gpu_report.targets(result)
    write(rt, args.out, result)
    return result


def write(rt: gpu_env.Runtime, out: Path | None, result: dict[str, Any]) -> None:
    """Rank 0 writes what is measured so far: a run cut short by a time limit still leaves its numbers."""
    if out is None or rt.rank != 0:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def failures(result: dict[str, Any]) -> list[str]:
    found = [k for k in SECTIONS if "error" in result.get(k, {})]
    return found + [v["name"] for v in result.get("train", {}).get("variants", []) if "error" in v]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rt = gpu_env.start(args.device)
    try:
        result = run(args, rt)
    finally:
        gpu_env.stop()
    if rt.rank != 0:
        return 0
    failed = failures(result)
    print(gpu_report.render(result), flush=True)
    if failed:
        print(f"bench/gpu.py: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
