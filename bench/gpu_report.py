"""bench/gpu.py's results as Markdown tables (pasteable into docs/benchmarks.md) and target checks."""

from __future__ import annotations

from typing import Any

TARGET_MFU = 0.45
"""Issue target: MFU of the ~1B model in bf16 on one H100."""
TARGET_ASYNC_STALL_SECONDS = 1.0
"""Issue target: the training loop blocked at most this long by an asynchronous checkpoint."""


def _num(value: float | None, fmt: str = ",.0f") -> str:
    return "—" if value is None else format(value, fmt)


def _gib(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / 2**30:.1f}"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def baseline_for(variants: list[dict[str, Any]], compiled: bool) -> dict[str, Any] | None:
    """The hand-written loop's result with the same compile setting, if it ran."""
    for v in variants:
        if v["loop"] == "baseline" and v["compiled"] == compiled and "tokens_per_second" in v:
            return v
    return None


def train_table(train: dict[str, Any]) -> list[str]:
    lines = [
        f"throughput: {train['precision']}, micro batch {train['micro_batch']} x accumulation {train['grad_accum']}"
        f" x {train['world_size']} process(es) = {train['tokens_per_step']:,} tokens/step,"
        f" {train['warmup']} warm-up + {train['steps']} timed steps (median); attention kernel {train['attention']}",
        "",
        "| variant | step s | tokens/s | tokens/s/device | MFU | peak mem GiB | vs baseline | first step s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in train["variants"]:
        if "error" in v:
            lines.append(f"| {v['name']} | {v['error'][:80]} |  |  |  |  |  |  |")
            continue
        base = baseline_for(train["variants"], v["compiled"])
        ratio = v["tokens_per_second"] / base["tokens_per_second"] if base else None
        mfu = _num(v["mfu"] * 100, ".1f") + "%" if v["mfu"] is not None else "—"
        lines.append(
            f"| {v['name']} | {v['step_seconds_median']:.3f} | {v['tokens_per_second']:,.0f} |"
            f" {v['tokens_per_second_per_gpu']:,.0f} | {mfu} | {_gib(v['peak_memory_bytes'])} | {_num(ratio, '.3f')} |"
            f" {_num(v.get('first_step_seconds'), '.2f')} |"  # a compiled variant's compilation (older results: —)
        )
    return lines


def allreduce_table(ar: dict[str, Any]) -> list[str]:
    lines = [
        f"all-reduce: {ar['backend']}, {ar['world_size']} rank(s), {ar['dtype']} sum, {ar['iters']} iterations"
        f" after {ar['warmup']} warm-up; {ar['note']}",
        "",
        "| size | time us | algbw GB/s | busbw GB/s |",
        "|---:|---:|---:|---:|",
    ]
    for row in ar["sizes"]:
        lines.append(
            f"| {_size(row['bytes'])} | {row['seconds'] * 1e6:,.1f} | {row['algbw_gbps']:.2f} |"
            f" {_num(row['busbw_gbps'], '.2f')} |"
        )
    return lines


def checkpoint_table(ck: dict[str, Any]) -> list[str]:
    lines = [
        f"checkpoint: dcp, model + optimizer state {ck['state_bytes_per_rank'] / 1e9:.3f} GB per rank,"
        f" {ck['saves']} saves per mode, {ck['gap_steps']} training steps between saves, in {ck['dir']}",
        "",
        "| mode | stall s (first) | stall s (steady) | write s (median) | waited for previous s (max) |"
        " step s between saves |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in ("sync", "async"):
        m = ck[mode]
        lines.append(
            f"| {mode} | {m['stall_first_seconds']:.3f} | {m['stall_steady_seconds']:.3f} |"
            f" {_num(m['write_seconds_median'], '.3f')} | {max(m['waited_seconds']):.3f} |"
            f" {m['gap_step_seconds_median']:.3f} |"
        )
    return lines


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets against this run; null where the run cannot say (a --tiny run, no peak, not run)."""
    out: dict[str, Any] = {"mfu_min": TARGET_MFU, "async_stall_max_seconds": TARGET_ASYNC_STALL_SECONDS}
    if result["tiny"]:
        out.update(best_trainer_mfu=None, mfu_met=None, async_stall_seconds=None, async_stall_met=None,
                   note="--tiny: the targets apply to the ~1B model on a GPU")
        return out
    mfus = [v["mfu"] for v in result.get("train", {}).get("variants", [])
            if v.get("loop") == "trainer" and v.get("mfu") is not None]
    best = max(mfus) if mfus else None
    stall = result.get("checkpoint", {}).get("async", {}).get("stall_steady_seconds")
    out.update(
        best_trainer_mfu=best,
        mfu_met=None if best is None else best >= TARGET_MFU,
        async_stall_seconds=stall,
        async_stall_met=None if stall is None else stall <= TARGET_ASYNC_STALL_SECONDS,
    )
    return out


def render(result: dict[str, Any]) -> str:
    dev, model = result["device"], result["model"]
    peak = result["peak_tflops"]
    lines = [
        f"kubetrain GPU benchmark{' (--tiny)' if result['tiny'] else ''}: {dev['name']} ({dev['type']},"
        f" {dev['count']} process(es)), torch {dev['torch']}, peak {_num(peak, ',.0f')} TFLOP/s"
        f" ({result['peak_source'] or 'unknown: MFU not computed'})",
        f"model: kubetrain Transformer d {model['d_model']}, {model['n_layers']} layers, {model['n_heads']} heads,"
        f" seq {model['seq_len']}, vocab {model['vocab_size']}: {model['params_total']:,} parameters"
        f" ({model['params_non_embedding']:,} without embeddings), {model['flops_per_token'] / 1e9:.3f} GFLOP/token",
    ]
    for key, table in (("train", train_table), ("allreduce", allreduce_table), ("checkpoint", checkpoint_table)):
        if "error" in result.get(key, {}):
            lines += ["", f"{key}: FAILED: {result[key]['error'][:300]}"]
        elif key in result:
            lines += ["", *table(result[key])]
    t = result["targets"]
    if result["tiny"]:
        lines += ["", "targets: not judged (--tiny; they apply to the ~1B model on a GPU)"]
    else:
        lines += ["", f"targets: MFU >= {t['mfu_min']:.0%}: {t['mfu_met']} (best trainer MFU"
                  f" {_num(t['best_trainer_mfu'], '.3f')}); async checkpoint stall <= {t['async_stall_max_seconds']} s:"
                  f" {t['async_stall_met']} (steady {_num(t['async_stall_seconds'], '.3f')} s)"]
    return "\n".join(lines)
