"""checkpoint.memory's pure decisions: the step the gang holds in common, memory or durable, the rank
directory's rules, and how both backends pass the tier and the pod's memory to their workers (the budget over
the pod's memory: test_memory_budget.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kubetrain.core import contract, local
from kubetrain.core.api import MemoryTierSpec, TrainingJob
from kubetrain.core.progress import COMMIT_MARKER, checkpoint_dirname
from kubetrain.operator.jobs import builders as b
from kubetrain.trainer.checkpoint.manager import ResumePlan, plan_resume
from kubetrain.trainer.checkpoint.memory import (
    MemoryTier,
    Offer,
    TierSettings,
    choose_tier,
    common_step,
)

MiB = 2**20


@pytest.mark.parametrize(("held", "common"), [
    ([[10, 20], [10, 20]], 20),
    ([[10, 20], [10]], 10),  # rank 1 died before it committed 20
    ([[20], [10]], None),  # nothing in common: each kept only its newest
    ([[10, 20], []], None),  # a recreated pod: its /dev/shm is empty
    ([[10], None], None),  # a rank that keeps no tier
    ([[30, 10, 20]], 30),
    ([], None),
])
def test_the_gang_resumes_from_the_newest_step_every_rank_holds(held, common):
    assert common_step(held) == common


@pytest.mark.parametrize(("memory", "durable", "tier"), [
    (30, 20, "memory"),
    (20, 20, "memory"),  # the same step: the faster load
    (10, 20, "durable"),
    (None, 20, "durable"),
    (10, None, "memory"),
    (None, None, None),
])
def test_memory_wins_when_at_least_as_new_as_the_durable_tier(memory, durable, tier):
    assert choose_tier(memory, durable) == tier


def _offer(*steps: int, fits: bool = True) -> Offer:
    return Offer(tuple(steps), fits)


@pytest.mark.parametrize(("offers", "durable", "plan"), [
    ([_offer(10, 30), _offer(30)], (20, "/c/20"), ResumePlan("memory", 30, None, True)),
    ([_offer(20), _offer(20)], (20, "/c/20"), ResumePlan("memory", 20, None, True)),
    ([_offer(30), _offer()], (20, "/c/20"), ResumePlan("durable", 20, "/c/20", True)),  # a recreated pod
    ([_offer(), _offer()], None, ResumePlan(None, 0, None, True)),
    ([None, None], (20, "/c/20"), ResumePlan("durable", 20, "/c/20", False)),  # the tier is off
    ([_offer(30), _offer(30, fits=False)], (20, "/c/20"), ResumePlan("memory", 30, None, False, (1,))),
])
def test_resume_plan(offers, durable, plan):
    assert plan_resume(offers, durable) == plan


def _commit(root: Path, step: int, rank: int = 0, world_size: int = 2, strategy: str = "fsdp") -> Path:
    path = root / f"rank-{rank}" / checkpoint_dirname(step)
    path.mkdir(parents=True)
    (path / COMMIT_MARKER).write_text(json.dumps({"step": step, "rank": rank, "worldSize": world_size,
                                                  "strategy": strategy}))
    return path


def _tier(root: Path) -> MemoryTier:
    return MemoryTier(TierSettings(root, 10, None), engine=None, rank=0, world_size=2, strategy="fsdp")  # type: ignore[arg-type]


def test_a_rank_offers_only_its_complete_steps_of_this_gangs_shape(tmp_path):
    _commit(tmp_path, 10)
    _commit(tmp_path, 20, world_size=4)  # another world size's
    _commit(tmp_path, 30, strategy="ddp")
    (tmp_path / "rank-0" / checkpoint_dirname(40)).mkdir()  # torn: no COMMITTED
    assert [s for s, _ in _tier(tmp_path).held()] == [10]


def test_steps_after_the_resumed_one_are_deleted_and_a_tier_turned_off_is_emptied(tmp_path):
    tier = _tier(tmp_path)
    for step in (10, 20, 30):
        _commit(tmp_path, step)
    tier.keep_only_up_to(20)  # the gang resumed from 20 (the durable tier, say): 30 is another lineage
    assert [s for s, _ in tier.held()] == [10, 20]
    tier.turn_off()
    assert not (tmp_path / "rank-0").exists() and not tier.active and not tier.due(40, final=False)


def test_settings_from_the_contract(tmp_path):
    spec = TrainingJob.model_validate({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                       "metadata": {"name": "j"}, "spec": {}}).spec
    assert TierSettings.from_env({}, spec) is None
    env = {contract.MEMORY_CKPT_DIR: str(tmp_path), contract.MEMORY_CKPT_EVERY: "7",
           contract.MEMORY_CKPT_BYTES: "1000", contract.LOCAL_WORLD_SIZE: "4"}
    assert TierSettings.from_env(env, spec) == TierSettings(tmp_path, 7, 1000, 4)
    assert TierSettings.from_env({contract.MEMORY_CKPT_DIR: str(tmp_path)}, spec) == TierSettings(tmp_path, 10, None)


# --------------------------------------------------------------------------- the backends


def _job(**spec) -> TrainingJob:
    return TrainingJob.model_validate({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                       "metadata": {"name": "llm", "namespace": "a"}, "spec": spec})


def _env(job: TrainingJob) -> dict[str, str]:
    pod = b.worker_pod(job, 0, 0, b.WorkerSettings())
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}


def test_budget_is_the_share_of_the_workers_memory_per_process():
    assert MemoryTierSpec(memory_share=0.25).budget_bytes(16 * 2**30, 4) == 2**30


@pytest.mark.parametrize(("resources", "procs", "budget"), [
    ({"memory": "64Gi"}, 1, 16 * 2**30),  # the pod's memory limit
    ({"memory": "64Gi"}, 4, 4 * 2**30),  # per process
    ({"shmSize": "8Gi"}, 1, 2 * 2**30),  # no memory limit: /dev/shm's size
])
def test_worker_pods_get_the_tier_in_their_dev_shm(resources, procs, budget):
    env = _env(_job(resources=resources, procsPerWorker=procs, checkpoint={"memory": {"everySteps": 5}}))
    assert env[contract.MEMORY_CKPT_DIR] == contract.POD_MEMORY_CKPT_DIR
    assert contract.POD_MEMORY_CKPT_DIR.startswith("/dev/shm/")  # the pod's memory emptyDir
    assert (env[contract.MEMORY_CKPT_EVERY], int(env[contract.MEMORY_CKPT_BYTES])) == ("5", budget)


def _pod(job: TrainingJob) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker container's env by name, and the pod's /dev/shm volume."""
    pod = b.worker_pod(job, 0, 0, b.WorkerSettings())
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    return env, next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")


@pytest.mark.parametrize(("spec", "size_limit"), [
    # the tier's share of the memory limit (0.25 x 64Gi) joins /dev/shm: its files live there
    ({"resources": {"memory": "64Gi"}, "procsPerWorker": 4}, 16 * 2**30 + 16 * 2**30),
    ({"resources": {"memory": "64Gi", "shmSize": "1Gi"}, "checkpoint": {"memory": {"memoryShare": 0.5}}},
     2**30 + 32 * 2**30),
    ({"resources": {"shmSize": "8Gi"}}, 8 * 2**30),  # no memory limit: no share to add
    ({"resources": {"memory": "64Gi"}, "checkpoint": {"memory": {"enabled": False}}}, 16 * 2**30),
])
def test_worker_pods_tell_the_trainer_their_memory_and_size_dev_shm_for_the_tier(spec, size_limit):
    job = _job(**spec)
    env, dshm = _pod(job)
    assert int(b.quantity_value(dshm["emptyDir"]["sizeLimit"])) == size_limit
    assert int(env[contract.SHM_BYTES]["value"]) == size_limit
    assert env[contract.MEMORY_PROCS]["value"] == str(job.spec.procs)
    assert env[contract.MEMORY_LIMIT]["valueFrom"] == {"resourceFieldRef": {"resource": "limits.memory",
                                                                            "divisor": "1"}}


def test_a_local_run_tells_its_ranks_the_machines_memory(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text("MemTotal:       16384000 kB\nMemFree:  1 kB\n")
    (tmp_path / "memory.max").write_text("8589934592\n")
    monkeypatch.setattr(local, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(local, "CGROUP_MEMORY_MAX", tmp_path / "memory.max")
    assert local.machine_memory_bytes() == 8 * 2**30  # the container's cgroup limit, below MemTotal
    (tmp_path / "memory.max").write_text("max\n")
    assert local.machine_memory_bytes() == 16384000 * 1024
    run = local.LocalRun(_job(workers=2, procsPerWorker=2, command=["python", "train.py"]), tmp_path,
                         local.RunOptions(output_dir=tmp_path / "out"))
    env = run._worker_env(1, 0, 29999)
    assert (env[contract.MEMORY_LIMIT], env[contract.MEMORY_PROCS]) == (str(16384000 * 1024), "4")  # every rank
    assert int(env[contract.SHM_BYTES]) == local.shm_bytes()


@pytest.mark.parametrize("spec", [
    {"checkpoint": {"memory": {"enabled": False}}},
    {"restartPolicy": {"inPlace": False}},  # every restart recreates the pods: nothing in memory survives
    {"podTemplate": {"spec": {"volumes": [{"name": "dshm", "hostPath": {"path": "/dev/shm"}}]}}},
])
def test_no_tier_where_a_pods_memory_cannot_serve_a_restart(spec):
    assert contract.MEMORY_CKPT_DIR not in _env(_job(**spec))


def test_the_contract_env_carries_the_tier_for_both_backends():
    base = dict(job="j", namespace="n", config_path="c", checkpoint_dir="d", output_dir="o", restart_generation=0,
                metrics_port=1)
    assert contract.MEMORY_CKPT_DIR not in contract.kubetrain_env(**base)
    env = contract.kubetrain_env(**base, memory_tier=contract.MemoryTier("/dev/shm/x", 10, 123))
    assert (env[contract.MEMORY_CKPT_DIR], env[contract.MEMORY_CKPT_EVERY], env[contract.MEMORY_CKPT_BYTES]) == (
        "/dev/shm/x", "10", "123")


def test_a_local_run_gives_its_ranks_one_private_directory_in_dev_shm_and_removes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    run = local.LocalRun(_job(workers=2, procsPerWorker=2, command=["python", "train.py"]), tmp_path,
                         local.RunOptions(output_dir=tmp_path / "out"))
    assert contract.MEMORY_CKPT_DIR not in run._worker_env(0, 0, 29999)  # made by run() only: no side effect
    run._make_memory_tier()
    envs = [run._worker_env(n, 0, 29999) for n in range(2)]
    where = Path(envs[0][contract.MEMORY_CKPT_DIR])
    assert {e[contract.MEMORY_CKPT_DIR] for e in envs} == {str(where)} and where.parent == tmp_path / "shm"
    assert where.stat().st_mode & 0o777 == 0o700 and where.name.startswith(f"kubetrain-{os.getuid()}-{os.getpid()}-")
    size = os.statvfs(tmp_path / "shm")
    assert int(envs[0][contract.MEMORY_CKPT_BYTES]) == int(0.25 * size.f_blocks * size.f_frsize) // 4  # 4 ranks
    run._remove_memory_tier()
    assert not where.exists()
