"""A rank whose NCCL collective failed exits contract.PEER_LOST_EXIT_CODE, as it does under gloo, rather than being
aborted by NCCL's watchdog (exit 134), which would blame a survivor for another rank's failure.

With TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (torch's default, which the trainer keeps: it is the mode the flight recorder
works with) ProcessGroupNCCL's watchdog thread, on a collective that failed (a peer gone: NCCL's remote error) or
timed out, records the error (`ProcessGroupNCCL.get_error()`), signals every rank to dump its flight recorder, sleeps
4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default) for the dumps, then rethrows in its own thread:
std::terminate, SIGABRT. The main thread meanwhile waits on the failed collective's stream and never raises, so
main.crashed never sees a Python exception to map.

This daemon thread polls every NCCL group's error. Once one is set it lets this rank's flight recorder dump finish
(the file TORCH_FR_DUMP_TEMP_FILE<rank> complete, or at most one dump timeout: before the watchdog's abort) and
exits PEER_LOST_EXIT_CODE. A rank's own CUDA fault (an illegal address, say) usually surfaces first: it raises in
the main thread (exit 1), or an event query throws in the watchdog, which ends the process at once (134, ranked
before a lost peer by contract.root_cause).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from kubetrain.core import contract

POLL_SECONDS = 0.5
DUMP_TIMEOUT_ENV = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
DEFAULT_DUMP_TIMEOUT_MS = 15_000
"""torch's default for DUMP_TIMEOUT_ENV (ProcessGroupNCCL's HeartbeatMonitor)."""
NO_ERROR = "SUCCESS"
"""torch._C._distributed_c10d.ErrorType's name for a group without an error (the others: TIMEOUT, COMM_ERROR,
REMOTE_ERROR)."""


def exit_code_for(errors: Iterable[str]) -> int | None:
    """The exit code for this rank given its NCCL groups' errors (ErrorType names): PEER_LOST_EXIT_CODE once any
    group's collective failed or timed out, else None (nothing to do)."""
    return contract.PEER_LOST_EXIT_CODE if any(e != NO_ERROR for e in errors) else None


def dump_grace_seconds(env: Mapping[str, str]) -> float:
    """How long to let the flight recorder's dump run: torch's own dump timeout (DUMP_TIMEOUT_ENV), 0 where the
    dump on error is off (TORCH_NCCL_DUMP_ON_TIMEOUT=0). The watchdog aborts 4 dump timeouts after the error."""
    if env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "1").strip().lower() in ("0", "false", "no", "off"):
        return 0.0
    try:
        return max(0, int(env.get(DUMP_TIMEOUT_ENV, DEFAULT_DUMP_TIMEOUT_MS))) / 1000
    except ValueError:
        return DEFAULT_DUMP_TIMEOUT_MS / 1000


def dump_file(env: Mapping[str, str], rank: int) -> Path:
    """Where NCCL's watchdog writes this rank's dump: TORCH_FR_DUMP_TEMP_FILE (or its older name) + rank, else
    torch's default `${XDG_CACHE_HOME:-$HOME/.cache}/torch/comm_lib_trace_rank_<rank>`."""
    prefix = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if not prefix:
        cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or "/tmp", ".cache"))
        prefix = str(Path(cache, "torch", "comm_lib_trace_rank_"))
    return Path(f"{prefix}{rank}")


def dump_settled(elapsed: float, grace: float, size_before: int | None, size_now: int | None) -> bool:
    """Whether to stop waiting for this generation's dump: the grace is over, or the file is there and did not
    grow over the last poll (sizes None: no file of this generation yet)."""
    return elapsed >= grace or (size_now is not None and size_now > 0 and size_now == size_before)


def nccl_errors() -> list[str]:
    """The error of every NCCL group of this process (ErrorType names); [] without one."""
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415 - once a gang exists

    nccl = getattr(torch._C._distributed_c10d, "ProcessGroupNCCL", None)  # absent from CPU-only builds
    cuda = torch.device("cuda")
    errors = []
    for pg in list(c10d._world.pg_map):  # as torch's own _set_pg_timeout walks the groups
        if nccl is not None and cuda in pg._device_types:
            backend = pg._get_backend(cuda)
            if isinstance(backend, nccl):
                errors.append(backend.get_error().name)
    return errors


def _size(path: Path, since: float) -> int | None:
    """The file's size when it was written at or after `since` (wall clock; an older one is an earlier
    generation's dump), else None."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size if st.st_mtime >= since else None


def _await_dump(path: Path, grace: float, since: float) -> None:
    start, before = time.monotonic(), None
    while True:
        now = _size(path, since)
        if dump_settled(time.monotonic() - start, grace, before, now):
            return
        before = now
        time.sleep(POLL_SECONDS)


def _watch(rank: int, env: Mapping[str, str]) -> None:
    started = time.time()
    while True:
        time.sleep(POLL_SECONDS)
        try:
            errors = nccl_errors()
        except RuntimeError:  # a group created or destroyed while listed: look again
            continue
        code = exit_code_for(errors)
        if code is None:
            continue
        print(f"kubetrain.trainer: NCCL reported {', '.join(e for e in errors if e != NO_ERROR)} on a collective "
              f"(another rank went away or stopped answering); exiting {code} before NCCL's watchdog aborts this "
              "rank (look for the first failure among the other ranks)", file=sys.stderr, flush=True)
        _await_dump(dump_file(env, rank), dump_grace_seconds(env), started)
        sys.stdout.flush()
        os._exit(code)  # the watchdog's abort is on its way: no interpreter teardown


def start(rank: int, env: Mapping[str, str] | None = None) -> threading.Thread:
    """Start the daemon thread (after init_process_group on NCCL)."""
    thread = threading.Thread(target=_watch, args=(rank, dict(os.environ if env is None else env)),
                              name="kubetrain-nccl-watch", daemon=True)
    thread.start()
    return thread
