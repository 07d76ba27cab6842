"""A torchrun-style script whose rank HANG_RANK gets stuck (a sleep, as in a wedged data loader) at step
HANG_STEP of generation 0, while the others wait for it in all_reduce. It reports each step through
kubetrain.core.hangs.write_beat, as a custom script does to have its ranks watched.

Usage: python hang_script.py STEPS HANG_RANK HANG_STEP
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from kubetrain.core import contract, hangs


def load_next_batch(step: int, stuck: bool) -> torch.Tensor:
    if stuck:
        time.sleep(3600)
    return torch.full((4,), float(step))


def main() -> int:
    steps, hang_rank, hang_step = (int(a) for a in sys.argv[1:4])
    dist.init_process_group("gloo")
    rank, first = dist.get_rank(), os.environ.get(contract.RESTART_GENERATION) == "0"
    for step in range(1, steps + 1):
        batch = load_next_batch(step, first and rank == hang_rank and step == hang_step)
        dist.all_reduce(batch)
        hangs.write_beat(step)
        time.sleep(0.25)  # longer than write_beat's 0.2 s between beats of one phase: every step is recorded
    print(f"done rank={rank}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
