"""How fast bf16 math is on this machine's CPU.

CPUs with AVX512-BF16 or AMX (x86) or the BF16 extension (Arm) do bf16 arithmetic in hardware; others
convert to fp32 and back, AVX-512 ones included: on a 2-core Xeon with AVX-512 but no AVX512-BF16 the
quickstart trained about 2x slower in bf16 than in fp32 (docs/trainer.md). torch's
`torch.ops.mkldnn._is_mkldnn_bf16_supported()` is True there too (oneDNN has bf16 kernels for any
AVX-512 CPU), so the flags decide "emulated". A run on the CPU with `precision: bf16` also measures a
bf16 against an fp32 matrix product before it starts, and says so when bf16 is the slower one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""x86 (flags) and Arm (Features) names of native bf16 arithmetic."""
CPUINFO = Path("/proc/cpuinfo")
SLOW_BF16 = 1.5
"""A bf16/fp32 time ratio from which a CPU run with precision bf16 is told to use fp32."""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags listed in /proc/cpuinfo text (x86 `flags`, Arm `Features`)."""
    out: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            out.update(value.split())
    return out


def native_bf16(flags: Iterable[str]) -> bool:
    return not BF16_FLAGS.isdisjoint(flags)


def this_cpu_native_bf16() -> bool | None:
    """None where /proc/cpuinfo cannot be read (not Linux): unknown."""
    try:
        return native_bf16(cpu_flags(CPUINFO.read_text()))
    except OSError:
        return None


def bf16_slowdown(size: int = 256, repeats: int = 10, rounds: int = 3) -> float | None:
    """How many times as long a bf16 matrix product takes as an fp32 one on one core of this CPU (under
    0.1 s); None without torch (the operator's image has none).

    One thread: a worker's processes each get a share of the cores (contract.thread_env), and with two
    threads on a busy 2-core machine the ratio swung from 1.5x to 35x between runs. The dtypes
    alternate, and each keeps its best round, so a burst of load elsewhere slows both or neither."""
    try:
        import torch  # noqa: PLC0415 - core runs without torch in the operator image
    except ImportError:
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mats = {dtype: torch.randn(size, size).to(dtype) for dtype in (torch.bfloat16, torch.float32)}
        best = dict.fromkeys(mats, float("inf"))
        for _ in range(rounds + 1):  # one more: the first is the slowest (kernel selection, first touch)
            for dtype, a in mats.items():
                t0 = time.perf_counter()
                for _ in range(repeats):
                    torch.mm(a, a)
                best[dtype] = min(best[dtype], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)  # rank 0 of a pod measures in the process that then trains
    return round(best[torch.bfloat16] / max(best[torch.float32], 1e-9), 1)


def bf16_notice(slowdown: float | None, native: bool | None) -> str | None:
    """What a CPU run with precision bf16 is told, when bf16 is the slower one here."""
    if slowdown is None or slowdown < SLOW_BF16:
        return None
    why = " (no AVX512-BF16, AMX or Arm BF16: bf16 is emulated)" if native is False else ""
    return (f"bf16 is slow on this CPU{why}: a bf16 matrix product took {slowdown:.1f}x as long as fp32 on one core; "
            "`precision: fp32` trains faster here")
