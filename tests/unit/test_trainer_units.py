"""Pure pieces of the trainer (no process group): data, schedule, config, model, checkpoints."""

from __future__ import annotations

import io
import json
import math
import os
import traceback
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from kubetrain.core import contract
from kubetrain.core.api import DataSpec, ModelSpec, OptimizerSpec, TrainingJobSpec
from kubetrain.core.progress import COMMIT_MARKER, complete_checkpoints
from kubetrain.trainer.checkpoint.directory import TrainerState, missing_parts, prune, require_every_part
from kubetrain.trainer.config import ConfigError, load_spec, parse_fail_at, read_env
from kubetrain.trainer.data.text import Sampler, eval_batches, load_corpus, split_eval
from kubetrain.trainer.main import await_generation, peer_lost
from kubetrain.trainer.model import Transformer, flops_per_token
from kubetrain.trainer.observe.metrics import PEAK_FLOPS_ENV, peak_flops
from kubetrain.trainer.parallel.engines import deepspeed_config
from kubetrain.trainer.schedule import lr_factor


@pytest.fixture
def corpus() -> torch.Tensor:
    return torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)


def test_batches_are_a_pure_function_of_seed_and_step(corpus: torch.Tensor) -> None:
    a, b = Sampler(corpus, 16, seed=1), Sampler(corpus, 16, seed=1)
    x1, y1 = a.micro_batches(5, 2, 2, 2, 1)[1]
    x2, y2 = b.micro_batches(5, 2, 2, 2, 1)[1]
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (2, 16) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next tokens
    other_step = a.micro_batches(6, 2, 2, 2, 1)[1][0]
    other_seed = Sampler(corpus, 16, seed=2).micro_batches(5, 2, 2, 2, 1)[1][0]
    assert not torch.equal(x1, other_step) and not torch.equal(x1, other_seed)


def test_accumulation_splits_the_same_samples_per_rank(corpus: torch.Tensor) -> None:
    s = Sampler(corpus, 16, seed=3)
    for rank in range(2):
        ga2 = torch.cat([x for x, _ in s.micro_batches(4, 2, 2, 2, rank)])
        ga1 = s.micro_batches(4, 4, 1, 2, rank)[0][0]
        assert torch.equal(ga2, ga1)
    # the ranks together cover the global batch, disjointly by position
    r0 = s.micro_batches(4, 4, 1, 2, 0)[0][0]
    ws1 = s.micro_batches(4, 8, 1, 1, 0)[0][0]
    assert torch.equal(ws1[:4], r0)


def test_corpus_reads_sorted_files_and_rejects_tiny_data(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("world" * 10)
    (tmp_path / "a.txt").write_text("hello" * 10)
    (tmp_path / "skip.md").write_text("x" * 100)
    data = load_corpus(DataSpec(path=str(tmp_path)), seq_len=8)
    assert bytes(data.tolist()).startswith(b"hellohello") and b"x" not in bytes(data.tolist())
    with pytest.raises(ConfigError) as err:
        load_corpus(DataSpec(path=str(tmp_path), glob="*.rst"), seq_len=8)
    assert err.value.field == "data.glob"
    with pytest.raises(ConfigError) as err:
        load_corpus(DataSpec(path=str(tmp_path / "a.txt")), seq_len=100)
    assert err.value.field == "data.path"


def test_warmup_then_cosine_to_min_lr() -> None:
    opt = OptimizerSpec(lr=1.0, min_lr=0.1, warmup_steps=4)
    factors = [lr_factor(s, opt, 20) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert lr_factor(20, opt, 20) == pytest.approx(0.1)
    assert lr_factor(12, opt, 20) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(0, OptimizerSpec(lr=1.0, min_lr=0.1, warmup_steps=0), 10) == pytest.approx(1.0)


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    def err(spec: object) -> str:
        f = tmp_path / "c.json"
        f.write_text(json.dumps(spec))
        with pytest.raises(ConfigError) as e:
            load_spec(f)
        return e.value.field

    assert err({"precision": "fp8"}) == "precision"
    assert err({"optimizer": {"lr": -1}}) == "optimizer.lr"
    assert err({"strategy": "ddp", "fsdp": {}}) == "fsdp"
    assert err({"microBatchSize": 0}) == "microBatchSize"
    assert err({"checkpoint": {"futureField": 1}}) == "checkpoint.futureField"
    f = tmp_path / "newer.json"
    f.write_text(json.dumps({"futureField": True}))
    with pytest.raises(ConfigError, match=r"unknown to this trainer image \(kubetrain [0-9.]+\): set by a newer operator"):
        load_spec(f)
    with pytest.raises(ConfigError) as e:
        load_spec(tmp_path / "missing.json")
    assert e.value.field == "KUBETRAIN_CONFIG"
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"kind": "TrainingJob", "spec": {"strategy": "fsdp", "maxSteps": 3}}))
    assert load_spec(ok).max_steps == 3


def test_env_contract() -> None:
    env = read_env(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "KUBETRAIN_CONFIG": "/c.json",
            "KUBETRAIN_FAIL_AT": "1:7",
            "KUBETRAIN_DIST_TIMEOUT_SECONDS": "5",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (1, 2, 0, 29500)
    assert env.fail_at == (1, 7) and env.dist_timeout.total_seconds() == 5
    with pytest.raises(ConfigError, match="RANK"):
        read_env({"RANK": "2", "WORLD_SIZE": "2", "KUBETRAIN_CONFIG": "/c"})
    with pytest.raises(ConfigError, match="KUBETRAIN_FAIL_AT"):
        parse_fail_at("7")
    assert parse_fail_at("") is None


def test_deepspeed_config_merges_user_keys_under_ours() -> None:
    spec = TrainingJobSpec.model_validate(
        {
            "strategy": "deepspeed",
            "precision": "bf16",
            "microBatchSize": 3,
            "gradientAccumulationSteps": 2,
            "deepspeed": {
                "zeroStage": 3,
                "offloadOptimizer": True,
                "config": {"zero_optimization": {"stage": 1, "overlap_comm": True}, "train_batch_size": 1},
            },
        }
    )
    cfg = deepspeed_config(spec, world_size=4)
    assert cfg["train_batch_size"] == 24 and cfg["train_micro_batch_size_per_gpu"] == 3
    assert cfg["zero_optimization"] == {"stage": 3, "overlap_comm": True, "offload_optimizer": {"device": "cpu"}}
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"]["enabled"] is False
    assert cfg["zero_force_ds_cpu_optimizer"] is False  # a torch optimizer, no JIT-compiled DeepSpeed Adam


def _zero3_spec(workers_config: dict | None = None, **deepspeed: object) -> TrainingJobSpec:
    ds: dict[str, object] = {"zeroStage": 3, **deepspeed}
    if workers_config is not None:
        ds["config"] = workers_config
    return TrainingJobSpec.model_validate({"strategy": "deepspeed", "precision": "bf16", "deepspeed": ds})


# The built-in model at dModel 64: a block holds 12·64² + 13·64 parameters over 11 modules (itself, attn,
# mlp, 2 LayerNorms, 6 Linears), DeepSpeed's granularity 49984 // 11; the largest parameters are 256 x 64.
SMALL = ModelSpec(d_model=64, n_layers=3, n_heads=4, seq_len=32, vocab_size=256)


@pytest.mark.parametrize(("world", "offload_param", "want"), [
    (1, False, {"stage3_module_granularity_threshold": 4544, "stage3_param_persistence_threshold": 16384,
                "overlap_comm": False, "memory_efficient_linear": False}),
    (2, False, {"stage3_module_granularity_threshold": 4544}),
    (1, True, {"stage3_module_granularity_threshold": 4544, "offload_param": {"device": "cpu"}}),
])
def test_zero3_defaults_follow_the_model_and_world_size(world: int, offload_param: bool, want: dict) -> None:
    cfg = deepspeed_config(_zero3_spec(offloadParam=offload_param), world, Transformer(SMALL))
    assert cfg["zero_optimization"] == {"stage": 3, **want}


def test_zero3_blocks_are_not_units_when_a_parent_would_swallow_them() -> None:
    """A wrapper that holds nothing but the blocks has a finer granularity than one block: DeepSpeed (parents
    first) would fetch the whole model as one unit, so no threshold is set."""
    inner = Transformer(SMALL)
    wrapper = torch.nn.Module()
    wrapper.model = torch.nn.Module()
    wrapper.model.layers = inner.blocks
    assert "stage3_module_granularity_threshold" not in deepspeed_config(_zero3_spec(), 2, wrapper)["zero_optimization"]


def test_user_keys_win_over_our_defaults_and_the_spec_wins_over_user_keys() -> None:
    user = {"zero_optimization": {"stage": 1, "overlap_comm": True, "stage3_module_granularity_threshold": 0,
                                  "reduce_bucket_size": 1000},
            "wall_clock_breakdown": True, "train_batch_size": 1, "bf16": {"enabled": False}}
    spec = _zero3_spec(user)
    cfg = deepspeed_config(spec, 1, Transformer(SMALL))
    assert cfg["zero_optimization"] == {"stage": 3, "overlap_comm": True, "stage3_module_granularity_threshold": 0,
                                        "reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 16384,
                                        "memory_efficient_linear": False}
    assert cfg["wall_clock_breakdown"] is True and cfg["steps_per_print"] == 2**31 - 1
    assert cfg["train_batch_size"] == spec.micro_batch_size * spec.gradient_accumulation_steps > 1
    assert cfg["bf16"] == {"enabled": True}


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    spec = ModelSpec(d_model=16, n_layers=2, n_heads=2, seq_len=8, vocab_size=32)
    x = torch.randint(0, 32, (2, 8))
    grads = []
    for ac in (False, True):
        torch.manual_seed(0)
        m = Transformer(spec, activation_checkpointing=ac)
        m(x, x).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert flops_per_token(m, spec) > 6 * m.num_params()


def test_model_is_causal() -> None:
    spec = ModelSpec(d_model=16, n_layers=1, n_heads=2, seq_len=8, vocab_size=32)
    torch.manual_seed(0)
    m = Transformer(spec)
    x = torch.randint(0, 32, (1, 8))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 32
    emb = []
    for inp in (x, y):
        pos = torch.arange(8)
        h = m.tok(inp) + m.pos(pos)
        for b in m.blocks:
            h = b(h)
        emb.append(h)
    assert torch.allclose(emb[0][0, :-1], emb[1][0, :-1]) and not torch.allclose(emb[0][0, -1], emb[1][0, -1])


def test_prune_keeps_newest_and_drops_older_torn(tmp_path: Path) -> None:
    for step, committed in [(2, True), (4, True), (5, False), (6, True), (8, True), (9, False)]:
        d = tmp_path / f"step-{step:08d}"
        d.mkdir()
        if committed:
            (d / COMMIT_MARKER).write_text("{}")
    prune(tmp_path, keep=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [6, 8]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000008", "step-00000009"]


def test_prune_never_deletes_the_best_eval_checkpoint(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / COMMIT_MARKER).write_text("{}")
    prune(tmp_path, keep=1, best_eval=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 6]


def test_eval_text_is_held_out_or_read_from_eval_path(tmp_path: Path) -> None:
    corpus = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    spec = TrainingJobSpec.model_validate({"evalEverySteps": 5, "model": {"seqLen": 16}, "microBatchSize": 2})
    train, held = split_eval(corpus, spec)
    assert held is not None and (train.numel(), held.numel()) == (950, 50)  # the last 5%, not trained on
    assert split_eval(corpus, TrainingJobSpec()) == (corpus, None)
    (tmp_path / "eval.txt").write_text("x" * 100)
    with_path = spec.model_copy(update={"data": DataSpec(evalPath=str(tmp_path / "eval.txt"))})
    train, held = split_eval(corpus, with_path)
    assert train.numel() == 1000 and held is not None and held.numel() == 100
    with pytest.raises(ConfigError, match="evalEverySteps"):
        split_eval(corpus[:40], spec)
    mine, theirs = eval_batches(corpus, spec, 2, 0), eval_batches(corpus, spec, 2, 1)
    assert len(mine) == spec.eval_batches and not torch.equal(mine[0][0], theirs[0][0])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(mine, eval_batches(corpus, spec, 2, 0), strict=True))


def test_trainer_state_ignores_unknown_keys() -> None:
    state = TrainerState.from_json({"step": 3, "checkpoints": [3], "future": 1})
    assert state.step == 3 and state.checkpoints == [3]


def test_peak_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    assert peak_flops(torch.device("cpu"), "bf16") is None
    monkeypatch.setenv(PEAK_FLOPS_ENV, "1e12")
    assert peak_flops(torch.device("cpu"), "bf16") == 1e12


def test_a_checkpoint_is_committed_only_with_every_ranks_part(tmp_path: Path) -> None:
    (tmp_path / "rng").mkdir()
    (tmp_path / "rng" / "rank-00000.pt").write_bytes(b"x")
    assert missing_parts(tmp_path, 2) == [1]
    with pytest.raises(ConfigError, match=r"spec.checkpoint: .*rank\(s\) \[1\].*not shared by all workers"):
        require_every_part(tmp_path, 2, within=0)
    (tmp_path / "rng" / "rank-00001.pt").write_bytes(b"x")
    require_every_part(tmp_path, 2, within=0)


def test_device_memory_is_exported_per_kind() -> None:
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from kubetrain.trainer.observe.metrics import Metrics  # noqa: PLC0415

    registry = CollectorRegistry()
    Metrics("llm", 3, None, registry).observe_device_memory(allocated=10, reserved=30, peak=20)
    for kind, value in (("allocated", 10), ("reserved", 30), ("peak", 20)):
        assert registry.get_sample_value("kubetrain_trainer_device_memory_bytes",
                                         {"job": "llm", "rank": "3", "kind": kind}) == value


def test_a_standby_rank_runs_the_generation_its_launcher_hands_it_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contract.STANDBY, "1")
    monkeypatch.setenv(contract.RESTART_GENERATION, "0")
    monkeypatch.setattr("sys.stdin", io.StringIO("4\n"))
    assert await_generation()
    assert os.environ[contract.RESTART_GENERATION] == "4" and contract.STANDBY not in os.environ
    monkeypatch.setenv(contract.STANDBY, "1")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # the launcher went another way
    assert not await_generation()


def test_a_local_runs_metrics_listen_on_loopback_only(tmp_path: Path) -> None:
    """`kubetrain run` prints http://127.0.0.1:PORT: the endpoint must not be on every interface of a laptop."""
    import psutil  # noqa: PLC0415
    from prometheus_client import CollectorRegistry  # noqa: PLC0415
    from support.ports import free_port  # noqa: PLC0415

    from kubetrain.core.api import TrainingJob  # noqa: PLC0415
    from kubetrain.core.local import LocalRun, RunOptions  # noqa: PLC0415
    from kubetrain.trainer.observe.metrics import Metrics  # noqa: PLC0415

    job = TrainingJob.model_validate({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                      "metadata": {"name": "t"}, "spec": {}})
    env = LocalRun(job, tmp_path, RunOptions(output_dir=tmp_path / "out"))._worker_env(0, 0, free_port())
    env[contract.CONFIG] = str(tmp_path / "config.json")
    parsed = read_env(env)
    assert parsed.metrics_addr == "127.0.0.1"
    port = free_port()
    Metrics("t", 0, port, CollectorRegistry(), addr=parsed.metrics_addr)
    listening = {c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", port) in listening and ("0.0.0.0", port) not in listening


def test_a_checkpoint_exception_of_lost_peers_is_a_lost_peer_and_of_a_rank_s_own_failure_is_not() -> None:
    """DCP wraps each rank's failure in a CheckpointException, a BaseException: a save or load cut by a peer
    that went away must still exit 3 (so the launcher blames the peer), a rank's own failure 1."""
    def wrapped(exc: BaseException) -> tuple[BaseException, traceback.StackSummary]:
        return exc, traceback.StackSummary()

    lost = RuntimeError("[gloo] Connection closed by peer [10.0.0.7]:4242")
    assert peer_lost(CheckpointException("load failed", {0: wrapped(lost), 1: wrapped(lost)}))
    assert not peer_lost(CheckpointException("save failed", {0: wrapped(lost), 1: wrapped(OSError(28, "No space"))}))
    assert not peer_lost(CheckpointException("save failed", {1: wrapped(OSError(28, "No space left on device"))}))
