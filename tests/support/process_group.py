"""A one-process gloo process group on CPU, for in-process tests of trainer pieces that call torch.distributed
(engines, checkpoint save and load)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from .ports import free_port


@contextmanager
def gloo_world_of_one(timeout: float = 30.0) -> Iterator[None]:
    """Rank 0 of world size 1 on a free loopback port; destroyed on exit, so the next test can start its own."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=timeout)
    )
    try:
        yield
    finally:
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        if ds_comm is not None and ds_comm.is_initialized():
            # A DeepSpeed engine (ZeRO-3) caches groups of this world; its own teardown drops them with it, so
            # the next test's engine does not reach for a destroyed group.
            ds_comm.destroy_process_group()
        else:
            dist.destroy_process_group()
