"""The flight recorder on a hang: torch.distributed's record of each rank's recent collectives, saved beside the
stacks so `torchfrtrace <dir>` can tell which collective which rank never joined. torch 2.13 keeps two recorders:
ProcessGroupNCCL's own (FlightRecorderCUDA, read by `_dump_nccl_trace`, which adds NCCL's communicator state) and
the generic one the other backends write (gloo's since torch 2.10, read by `_dump_fr_trace`); a gang on NCCL
dumps the first, any other the second (recorder_for).

A stuck main thread cannot dump it, but a collective's wait releases the GIL: a daemon thread watches the
heartbeat directory for the supervisor's request (kubetrain.core.hangs.DUMP_REQUEST, which names where to
write) and writes `fr_trace_rank_<RANK>` there (the pickle torchfrtrace reads). The NCCL watchdog's own dump
on a collective timeout goes to the pod's output directory (TORCH_FR_DUMP_TEMP_FILE), set before
init_process_group as torch requires.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import MutableMapping
from pathlib import Path

import torch

from kubetrain.core import contract, hangs

log = logging.getLogger("kubetrain.trainer")
POLL_SECONDS = 0.5


def prepare_env(env: MutableMapping[str, str]) -> None:
    """Before init_process_group: keep a trace buffer and dump it on an NCCL timeout (the user's env wins)."""
    where = env.get(contract.HEARTBEAT_DIR)
    if not where:
        return
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(where).parent / hangs.TRACE_PREFIX))


NCCL_RECORDER = "_dump_nccl_trace"
"""torch._C._distributed_c10d's dump of ProcessGroupNCCL's recorder (collectives, stack traces, NCCL's state)."""
GENERIC_RECORDER = "_dump_fr_trace"
"""Its dump of the recorder the other backends write (gloo); NCCL's collectives are not in it."""


def recorder_for(backend: str | None) -> str:
    """The dump function for a gang on `backend` (dist.get_backend(): "nccl", "gloo", or per device as
    "cpu:gloo,cuda:nccl"): NCCL's recorder wherever NCCL carries collectives, else the generic one."""
    parts = (backend or "").replace(",", ":").split(":")
    return NCCL_RECORDER if "nccl" in parts else GENERIC_RECORDER


def _backend() -> str | None:
    import torch.distributed as dist  # noqa: PLC0415 - only once a dump is asked for

    return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None


def dump(dest: str, rank: int, backend: str | None = None) -> Path | None:
    """This rank's trace as `dest/fr_trace_rank_<rank>` from the recorder of the gang's `backend` (default:
    the default group's); None where torch has none to give."""
    try:
        c10d = torch._C._distributed_c10d  # the dump API torchfrtrace reads, not in torch's stubs
        data = getattr(c10d, recorder_for(backend or _backend()))(True, True, False)  # collectives, stacks, all
        Path(dest).mkdir(parents=True, exist_ok=True)
        path = Path(dest, f"{hangs.TRACE_PREFIX}{rank}")
        path.with_suffix(".tmp").write_bytes(data)
        path.with_suffix(".tmp").replace(path)  # whole or absent: the supervisor waits for this name
        return path
    except (AttributeError, RuntimeError, OSError) as exc:
        log.warning("flight recorder: no trace written: %s", exc)
        return None


def watch_requests(rank: int, env: MutableMapping[str, str] | None = None) -> threading.Thread | None:
    """Start the daemon thread that dumps the trace once the supervisor asks (None: nothing supervises)."""
    where = (os.environ if env is None else env).get(contract.HEARTBEAT_DIR)
    if not where:
        return None
    request = Path(where, hangs.DUMP_REQUEST)
    Path(where, f"rank-{rank}{hangs.TRACE_READY}").touch()

    def run() -> None:
        while not request.exists():
            time.sleep(POLL_SECONDS)
        dump(request.read_text().strip(), rank)

    thread = threading.Thread(target=run, name="kubetrain-flight-recorder", daemon=True)
    thread.start()
    return thread
