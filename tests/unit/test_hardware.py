"""How fast bf16 is on this CPU (kubetrain.core.hardware), and what a CPU run with bf16 is told."""

from kubetrain.core import hardware

EPYC_ROME = "processor\t: 0\nflags\t\t: fpu vme avx2 fma sha_ni\nbogomips\t: 4491\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_native_bf16_from_cpuinfo():
    assert not hardware.native_bf16(hardware.cpu_flags(EPYC_ROME))
    assert hardware.native_bf16(hardware.cpu_flags(SAPPHIRE_RAPIDS))
    assert hardware.native_bf16(hardware.cpu_flags(GRAVITON3))
    assert hardware.cpu_flags("model name\t: x\n") == set()


def test_only_a_slower_bf16_is_worth_a_notice_and_it_says_what_to_do():
    text = hardware.bf16_notice(6.3, native=False)
    assert text is not None and "6.3x as long as fp32" in text and "emulated" in text and "precision: fp32" in text
    assert "emulated" not in (hardware.bf16_notice(2.0, native=None) or "")
    assert hardware.bf16_notice(0.7, native=False) is None  # AVX-512 without BF16: conversion is cheap
    assert hardware.bf16_notice(None, native=False) is None


def test_the_measurement_is_a_positive_ratio():
    ratio = hardware.bf16_slowdown(size=64, repeats=2)
    assert ratio is not None and ratio > 0
