"""The pods' memory budget for the checkpoints' copies (checkpoint/budget.py): background staging and the memory
tier, summed over each pod's processes, against the pod's memory limit, its /dev/shm and memoryShare's grant."""

from __future__ import annotations

import pytest

from kubetrain.core import contract
from kubetrain.trainer.checkpoint.budget import GangPlan, PodMemory, RankNeed, own_bytes, plan_gang

GiB = 2**30


def _ranks(n: int, state: float, own: float = 0, held: float = 0, free: float | None = None) -> list[RankNeed]:
    return [RankNeed(int(state * GiB), int(own * GiB), int(held * GiB), None if free is None else int(free * GiB))
            for _ in range(n)]


def _pod(limit: float | None, shm: float | None, procs: int, share: float | None) -> PodMemory:
    def b(x: float | None) -> int | None:
        return None if x is None else int(x * GiB)
    return PodMemory(b(limit), b(shm), procs, b(share))


@pytest.mark.parametrize(("case", "pod", "ranks", "staging", "tier_budgets", "notice"), [
    # 8 GPUs, 1000Gi limit, today's 16Gi /dev/shm: 8 x 2 x 1.5 GiB do not fit in it
    ("shm too small", _pod(1000, 16, 8, 250), _ranks(8, 1.5, own=20, free=16), True, None,
     "checkpoint.memory is off: worker 0: 2 copies of 8 process(es) x 1.50 GiB of state need 24.00 GiB, above its "
     "budget of 16.00 GiB (memoryShare of the pod's memory 250.00 GiB, room in /dev/shm 16.00 GiB, left of the "
     "1000.00 GiB memory limit 816.00 GiB)"),
    # the same pod with /dev/shm grown by the tier's share (the operator's sizeLimit): memoryShare bounds it
    ("shm grown", _pod(1000, 266, 8, 250), _ranks(8, 1.5, own=20, free=266), True, [250 * GiB // 8] * 8, None),
    # pipeline stages hold unequal states: the pod's sum fits where 3 + 3 GiB would exceed an even split (5 GiB)
    ("uneven", _pod(None, None, 2, 10), [RankNeed(3 * GiB, 0), RankNeed(1 * GiB, 0)], True,
     [int(7.5 * GiB), int(2.5 * GiB)], None),
    # what the memory limit leaves after the processes, staging and snapshots: nothing
    ("limit", _pod(64, 64, 8, 32), _ranks(8, 1, own=6, free=64), True, None,
     "left of the 64.00 GiB memory limit 0.0 MiB"),
    # the copies it already holds are room for the two it needs
    ("held", _pod(None, 8, 2, None), _ranks(2, 1, held=1, free=2), True, [4 * GiB // 2] * 2, None),
    ("held short", _pod(None, 8, 2, None), _ranks(2, 1, held=0.5, free=2), True, None, "room in /dev/shm 3.00 GiB"),
    # nothing known: nothing bounds it (each save still checks the free space)
    ("unbounded", _pod(None, None, 4, None), _ranks(4, 1), True, [None] * 4, None),
])
def test_the_tier_fits_the_pods_memory_summed_over_its_processes(case, pod, ranks, staging, tier_budgets, notice):
    plan = plan_gang(pod, ranks, staging=True, tier=True)
    assert plan.staging is staging, case
    assert (list(plan.tier_budgets) if plan.tier_budgets is not None else None) == tier_budgets, case
    if notice is None:
        assert plan.notices == (), case
    else:
        assert len(plan.notices) == 1 and notice in plan.notices[0], plan.notices
        assert plan.notices[0].endswith("restarts resume from the durable tier")


def test_every_budget_holds_two_copies_of_its_ranks_state():
    plan = plan_gang(_pod(None, None, 3, 9), [RankNeed(s * GiB, 0) for s in (2, 1, 1)], staging=False, tier=True)
    assert plan.tier_budgets is not None
    assert all(b is not None and b >= 2 * s * GiB for b, s in zip(plan.tier_budgets, (2, 1, 1), strict=True))


def test_staging_that_does_not_fit_makes_saves_synchronous_and_leaves_its_room_to_the_tier():
    # 8 x 7.5 GiB own + 8 x 1 GiB staged = 68 GiB > 64 GiB: no staging; the tier then needs 60 + 8 (snapshots) too
    plan = plan_gang(_pod(64, 64, 8, 32), _ranks(8, 1, own=7.5, free=64), staging=True, tier=True)
    assert not plan.staging and plan.tier_budgets is None
    assert plan.notices[0] == ("checkpoints are written synchronously: worker 0: staging 8 process(es) x 1.00 GiB "
                               "of state beside the processes' own 60.00 GiB exceeds the pod's memory limit of "
                               "64.00 GiB")
    roomier = plan_gang(_pod(100, 64, 8, 32), _ranks(8, 1, own=7.5, free=64), staging=True, tier=True)
    assert roomier.staging and roomier.tier_budgets == (3 * GiB,) * 8  # 100 - 60 own - 8 staged - 8 snapshots


def test_staging_alone_without_a_tier():
    assert plan_gang(_pod(64, None, 2, None), _ranks(2, 10, own=20), staging=True, tier=False) == \
        GangPlan(True, None, ())


def test_each_pod_is_planned_alone_and_the_gang_keeps_the_tier_only_where_all_fit():
    ranks = _ranks(2, 1, free=8) + _ranks(2, 1, free=3)  # worker 1's /dev/shm holds less
    plan = plan_gang(_pod(None, 8, 2, None), ranks, staging=False, tier=True)
    assert plan.tier_budgets is None and "worker 1: 2 copies of 2 process(es) x 1.00 GiB" in plan.notices[0]


def test_a_local_run_is_one_pod_of_every_rank():
    env = {contract.MEMORY_LIMIT: str(64 * GiB), contract.SHM_BYTES: str(32 * GiB), contract.MEMORY_PROCS: "4",
           contract.LOCAL_WORLD_SIZE: "2", contract.MEMORY_CKPT_BYTES: str(2 * GiB)}
    assert PodMemory.from_env(env) == PodMemory(64 * GiB, 32 * GiB, 4, 8 * GiB)  # memoryShare's grant x 4 processes


@pytest.mark.parametrize(("env", "pod"), [
    ({}, PodMemory(None, None, 1, None)),
    ({contract.LOCAL_WORLD_SIZE: "8"}, PodMemory(None, None, 8, None)),  # an older operator: procsPerWorker
    ({contract.MEMORY_LIMIT: "lots", contract.SHM_BYTES: "0"}, PodMemory(None, None, 1, None)),
])
def test_pod_memory_from_the_contract(env, pod):
    assert PodMemory.from_env(env) == pod


def test_a_cpu_process_still_needs_its_gradients_and_optimizer_states():
    assert own_bytes(5 * GiB, 3 * GiB, state_on_host=True) == 8 * GiB
    assert own_bytes(5 * GiB, 3 * GiB, state_on_host=False) == 5 * GiB
