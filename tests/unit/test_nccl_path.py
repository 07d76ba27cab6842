"""The NCCL path's decisions, on CPU: who is blamed when NCCL aborts a rank, which flight recorder a hang dump
reads, TF32 and the MFU peak, the model sizes MFU counts, fused AdamW, and no host read of the gradient norm."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.process_group import gloo_world_of_one

from kubetrain.core import contract
from kubetrain.core.api import ModelSpec, TrainingJobSpec
from kubetrain.core.lifecycle import JobView, WorkerPhase, WorkerState, decide
from kubetrain.trainer import loop
from kubetrain.trainer.model import HFCausalLM, Transformer, flops_per_token, hf_sizes
from kubetrain.trainer.observe import flight_recorder, metrics, nccl_watch
from kubetrain.trainer.parallel import engines

ABORT = contract.ABORTED_EXIT_CODE
LOST = contract.PEER_LOST_EXIT_CODE


# --------------------------------------------------------------------------- exit codes: who is blamed

@pytest.mark.parametrize(("codes", "blamed"), [
    ([ABORT, 137], 137),  # NCCL aborted the survivor before the killed rank was seen: the kill is the cause
    ([LOST, ABORT, 1], 1),
    ([LOST, ABORT], ABORT),  # an abort of its own (a CUDA fault in the watchdog) beats a lost peer
    ([ABORT, LOST], ABORT),
    ([ABORT, ABORT], ABORT),
    ([LOST, LOST], LOST),
    ([1, 137], 1),  # among failures of their own, the first seen
    ([], None),
])
def test_root_cause_ranks_an_abort_after_any_own_failure_and_before_a_lost_peer(codes, blamed):
    assert contract.root_cause(codes) == blamed


@pytest.mark.parametrize(("code", "order"), [(None, 0), (0, 0), (1, 0), (137, 0), (ABORT, 1), (LOST, 2)])
def test_blame_order(code, order):
    assert contract.blame_order(code) == order


def test_the_operator_names_the_killed_worker_not_the_one_nccl_aborted():
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    spec = TrainingJobSpec.model_validate({"workers": 3, "restartPolicy": {"backoffLimit": 2}})
    failed = WorkerPhase.FAILED
    workers = (WorkerState(0, failed, exit_code=ABORT), WorkerState(1, failed, exit_code=LOST),
               WorkerState(2, failed, exit_code=137))
    d = decide(spec, JobView(generation=0, workers=workers, start_time=t0), t0)
    assert d.message.startswith("worker 2 exited with code 137")


@pytest.mark.parametrize(("errors", "code"), [
    ([], None),  # gloo, or no group yet
    (["SUCCESS"], None),
    (["SUCCESS", "SUCCESS"], None),
    (["SUCCESS", "COMM_ERROR"], LOST),  # a subgroup's collective (FSDP's mesh) failed: NCCL's remote error
    (["TIMEOUT"], LOST),
    (["REMOTE_ERROR"], LOST),  # TORCH_NCCL_PROPAGATE_ERROR: another rank's error
])
def test_a_failed_nccl_collective_maps_to_peer_lost(errors, code):
    assert nccl_watch.exit_code_for(errors) == code


def test_the_error_names_are_torchs():
    error_type = torch._C._distributed_c10d.ErrorType
    assert set(error_type.__members__) == {"SUCCESS", "TIMEOUT", "COMM_ERROR", "REMOTE_ERROR"}
    assert error_type.SUCCESS.name == nccl_watch.NO_ERROR
    assert hasattr(torch._C._distributed_c10d.ProcessGroupNCCL, "get_error")


def test_a_gloo_gang_has_no_nccl_group_to_watch():
    with gloo_world_of_one():
        assert nccl_watch.nccl_errors() == []
    assert nccl_watch.nccl_errors() == []


@pytest.mark.parametrize(("env", "grace"), [
    ({}, 15.0),  # torch's default dump timeout
    ({"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "2000"}, 2.0),
    ({"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "soon"}, 15.0),
    ({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, 0.0),  # no dump to wait for
    ({"TORCH_NCCL_DUMP_ON_TIMEOUT": "false", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "2000"}, 0.0),
])
def test_the_dump_grace_is_torchs_dump_timeout(env, grace):
    assert nccl_watch.dump_grace_seconds(env) == grace


@pytest.mark.parametrize(("env", "path"), [
    ({"TORCH_FR_DUMP_TEMP_FILE": "/out/fr_trace_rank_"}, "/out/fr_trace_rank_3"),
    ({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/old/t_"}, "/old/t_3"),
    ({"XDG_CACHE_HOME": "/c", "HOME": "/h"}, "/c/torch/comm_lib_trace_rank_3"),
    ({"HOME": "/h"}, "/h/.cache/torch/comm_lib_trace_rank_3"),
    ({}, "/tmp/.cache/torch/comm_lib_trace_rank_3"),
])
def test_the_dump_file_is_where_ncclss_watchdog_writes_it(env, path):
    assert nccl_watch.dump_file(env, 3) == Path(path)


@pytest.mark.parametrize(("elapsed", "before", "now", "settled"), [
    (0.5, None, None, False),  # no dump yet
    (0.5, None, 100, False),  # appeared: wait one poll
    (1.0, 100, 200, False),  # still growing
    (1.5, 200, 200, True),  # complete
    (15.0, None, None, True),  # grace over
    (1.0, 0, 0, False),  # an empty file is not a dump
])
def test_the_wait_for_the_dump(elapsed, before, now, settled):
    assert nccl_watch.dump_settled(elapsed, 15.0, before, now) is settled


def test_a_rank_whose_nccl_group_failed_exits_peer_lost_after_its_dump(tmp_path):
    """The watcher end to end, in a process of its own: NCCL's error as get_error() would report it (no GPU
    here); it waits for the dump this generation writes (not the 60 s grace), then exits 3."""
    dump = tmp_path / "fr_trace_rank_"
    env = {"TORCH_FR_DUMP_TEMP_FILE": str(dump), "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "60000"}
    script = textwrap.dedent(f"""
        import threading, time
        from kubetrain.trainer.observe import nccl_watch
        nccl_watch.POLL_SECONDS = 0.05
        failed = threading.Event()
        nccl_watch.nccl_errors = lambda: ["SUCCESS", "COMM_ERROR"] if failed.is_set() else ["SUCCESS"]
        nccl_watch.start(0, {env!r})
        time.sleep(0.3)
        failed.set()
        time.sleep(0.5)
        print("dump written", flush=True)
        open({str(dump) + "0"!r}, "w").write("trace")
        time.sleep(30)
        print("not stopped", flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == LOST, run.stderr
    assert "NCCL reported COMM_ERROR" in run.stderr
    assert run.stdout == "dump written\n"  # it waited for the dump, and the dump (not the grace) ended the wait


# --------------------------------------------------------------------------- hang dumps: which recorder

@pytest.mark.parametrize(("backend", "recorder"), [
    ("nccl", "_dump_nccl_trace"),
    ("cpu:gloo,cuda:nccl", "_dump_nccl_trace"),
    ("cuda:nccl", "_dump_nccl_trace"),
    ("gloo", "_dump_fr_trace"),
    (None, "_dump_fr_trace"),
])
def test_a_nccl_gang_dumps_ncclss_recorder(backend, recorder):
    assert flight_recorder.recorder_for(backend) == recorder
    assert callable(getattr(torch._C._distributed_c10d, recorder))  # both exist in the installed torch


def test_the_dump_reads_the_chosen_recorder(tmp_path, monkeypatch):
    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *a: b"nccl")
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *a: b"generic")
    assert flight_recorder.dump(str(tmp_path), 1, backend="nccl").read_bytes() == b"nccl"
    assert flight_recorder.dump(str(tmp_path), 2, backend="gloo").read_bytes() == b"generic"
    with gloo_world_of_one():  # the gang's own backend when none is given
        assert flight_recorder.dump(str(tmp_path), 3).read_bytes() == b"generic"


# --------------------------------------------------------------------------- TF32 and the MFU peak

@pytest.mark.parametrize(("device", "precision", "tf32"), [
    ("cuda", "fp32", True), ("cuda", "bf16", False), ("cuda", "fp16", False), ("cpu", "fp32", False),
])
def test_tf32_is_on_for_fp32_on_cuda_only(device, precision, tf32):
    assert metrics.uses_tf32(device, precision) is tf32


@pytest.mark.parametrize(("name", "precision", "tf32", "peak"), [
    ("NVIDIA H100 80GB HBM3", "fp32", True, 494e12),
    ("NVIDIA H100 80GB HBM3", "fp32", False, None),  # plain FP32 units: not the TF32 peak
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989e12),
    ("NVIDIA A100-SXM4-80GB", "fp32", True, 156e12),
    ("NVIDIA A10", "bf16", False, 125e12),
    ("Some Other GPU", "bf16", False, None),
])
def test_the_peak_matches_what_the_matmuls_run_on(name, precision, tf32, peak):
    assert metrics.table_peak(name, precision, tf32) == peak


def test_an_fp32_run_on_cuda_divides_by_the_tf32_peak_it_runs_at(monkeypatch):
    monkeypatch.delenv(metrics.PEAK_FLOPS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert metrics.peak_flops(torch.device("cuda", 0), "fp32") == 494e12
    assert metrics.peak_flops(torch.device("cpu"), "fp32") is None


# --------------------------------------------------------------------------- MFU: the model's own sizes

def test_mfu_of_a_hugging_face_model_counts_its_config_not_the_builtin_defaults():
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - slow import, this test only

    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = HFCausalLM(LlamaForCausalLM(config))
    spec = ModelSpec(seq_len=32)  # n_layers 2, d_model 128: the built-in model's, not this one's
    n = sum(p.numel() for p in model.parameters()) - 100 * 64
    assert flops_per_token(model, spec) == 6.0 * n + 12.0 * 3 * 64 * 32


@pytest.mark.parametrize(("config", "sizes"), [
    (SimpleNamespace(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32), (32, 4096)),
    (SimpleNamespace(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, head_dim=128), (28, 2048)),
    (SimpleNamespace(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, head_dim=None), (2, 64)),
])
def test_hf_sizes(config, sizes):
    assert hf_sizes(config) == sizes


def test_mfu_of_the_builtin_model_is_unchanged():
    spec = ModelSpec(n_layers=3, d_model=32, n_heads=4, seq_len=16)
    model = Transformer(spec)
    assert flops_per_token(model, spec) == 6.0 * model.num_params(exclude_embeddings=True) + 12.0 * 3 * 32 * 16


# --------------------------------------------------------------------------- fused AdamW

F32, B16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(("devices", "dtypes", "offloaded", "fused"), [
    (["cuda", "cuda"], [F32, B16], False, True),
    (["cuda", "cpu"], [F32, F32], False, False),  # FSDP2 CPU offload keeps some on the host
    (["cpu"], [F32], False, False),  # CPU: torch's default, as before
    (["meta"], [F32], False, False),
    (["cuda"], [F32], True, False),  # DeepSpeed offload_optimizer steps host copies
    (["cuda"], [torch.int64], False, False),
    ([], [], False, False),
])
def test_fused_adamw_only_with_every_parameter_on_cuda(devices, dtypes, offloaded, fused):
    assert engines.fused_adamw(devices, dtypes, offloaded) is fused


def test_the_cpu_optimizer_stays_torchs_default():
    spec = TrainingJobSpec.model_validate({})
    opt = engines.make_optimizer(torch.nn.Linear(2, 2).parameters(), spec)
    assert opt.defaults["fused"] is None and opt.param_groups[0]["params"]


# --------------------------------------------------------------------------- no host read of the norm

def test_clipping_returns_the_norm_as_a_tensor_and_clips_as_before():
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    before = [p.grad.clone() for p in model.parameters()]
    norm = engines.clip_gradients(model, 100.0)
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float64  # nothing read on the host
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))  # below max: as is
    norm = engines.clip_gradients(model, 1.0)
    expected = 1.0 / (float(norm) + 1e-6)
    assert all(torch.equal(p.grad, b * expected) for p, b in zip(model.parameters(), before, strict=True))


def test_the_step_mean_is_one_all_reduce_read_once():
    with gloo_world_of_one():
        assert loop.weighted_mean(torch.tensor(2.5), 1.0, torch.device("cpu"), 1.0, 0.0) == [2.5, 1.0, 0.0]
