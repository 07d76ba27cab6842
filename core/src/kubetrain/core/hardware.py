"""How fast bf16 math is on this machine's CPU.

CPUs with AVX512-BF16 or AMX (x86) or the BF16 extension (Arm) do bf16 arithmetic in hardware; others
convert to fp32 and back. With AVX-512 that conversion is cheap, but on AVX2-only CPUs bf16 training
is several times slower than fp32. A run on the CPU with `precision: bf16` therefore measures a bf16
against an fp32 matrix product before it starts, and says so when bf16 is the slower one.
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


def bf16_slowdown(size: int = 256, repeats: int = 10) -> float | None:
    """How many times as long a bf16 matrix product takes as an fp32 one on this CPU (about 0.1 s);
    None without torch (the operator's image has none)."""
    try:
        import torch  # noqa: PLC0415 - core runs without torch in the operator image
    except ImportError:
        return None

    def seconds(dtype: torch.dtype) -> float:
        """The best of three timings: a busy machine only ever makes one slower."""
        a = torch.randn(size, size).to(dtype)
        torch.mm(a, a)  # warm-up: kernel selection, first-touch allocation
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(repeats):
                torch.mm(a, a)
            best = min(best, time.perf_counter() - t0)
        return best
    return round(seconds(torch.bfloat16) / max(seconds(torch.float32), 1e-9), 1)


def bf16_notice(slowdown: float | None, native: bool | None) -> str | None:
    """What a CPU run with precision bf16 is told, when bf16 is the slower one here."""
    if slowdown is None or slowdown < SLOW_BF16:
        return None
    why = " (no AVX512-BF16, AMX or Arm BF16: bf16 is emulated)" if native is False else ""
    return (f"bf16 is slow on this CPU{why}: a bf16 matrix product took {slowdown:.1f}x as long as fp32; "
            "`precision: fp32` trains faster here")
