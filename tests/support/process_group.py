"""A one-process gloo process group on CPU, for in-process tests of trainer pieces that call torch.distributed
(engines, checkpoint save and load)."""

from __future__ import annotations

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
        dist.destroy_process_group()
