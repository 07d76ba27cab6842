"""How fast bf16 is on this CPU (kubetrain.core.hardware), and what a CPU run with bf16 is told."""

import pytest

from kubetrain.core import hardware

EPYC_ROME = "processor\t: 0\nflags\t\t: fpu vme avx2 fma sha_ni\nbogomips\t: 4491\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ICE_LAKE = "flags\t\t: avx2 avx512f avx512bw avx512vl avx512_vnni avx512_vbmi2\n"  # AVX-512, no BF16
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_native_bf16_from_cpuinfo():
    assert not hardware.native_bf16(hardware.cpu_flags(EPYC_ROME))
    assert hardware.native_bf16(hardware.cpu_flags(SAPPHIRE_RAPIDS))
    assert not hardware.native_bf16(hardware.cpu_flags(ICE_LAKE))
    assert hardware.native_bf16(hardware.cpu_flags(GRAVITON3))
    assert hardware.cpu_flags("model name\t: x\n") == set()


def test_only_a_slower_bf16_is_worth_a_notice_and_it_says_what_to_do():
    text = hardware.bf16_notice(6.3, native=False)
    assert text is not None and "6.3x as long as fp32" in text and "emulated" in text and "precision: fp32" in text
    assert "emulated" not in (hardware.bf16_notice(2.0, native=None) or "")
    assert hardware.bf16_notice(0.7, native=False) is None  # bf16 no slower here: nothing to say
    assert hardware.bf16_notice(None, native=False) is None


def test_the_measurement_is_a_positive_ratio():
    ratio = hardware.bf16_slowdown(size=64, repeats=2)
    assert ratio is not None and ratio > 0


def test_the_measurement_is_on_one_core_and_leaves_torchs_threads_as_they_were(monkeypatch):
    torch = pytest.importorskip("torch")
    threads_seen, mm = set(), torch.mm
    monkeypatch.setattr(torch, "mm", lambda x, y: (threads_seen.add(torch.get_num_threads()), mm(x, y))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        hardware.bf16_slowdown(size=32, repeats=1, rounds=1)
        assert threads_seen == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert "as long as fp32 on one core" in (hardware.bf16_notice(5.4, native=False) or "")
