"""``python -m kubetrain.trainer``: the worker entrypoint.

Exit codes: 0 when maxSteps is reached (final checkpoint committed), 143 after a
SIGTERM/SIGINT checkpoint, 2 for configuration errors, 137 for an injected
failure (KUBETRAIN_FAIL_AT), 3 when a collective failed because another rank went away
(contract.PEER_LOST_EXIT_CODE), 1 for other crashes.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path

from kubetrain.core import contract


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s rank%(rank)s %(message)s")
    _install_rank_filter()
    # Several processes per worker, a pod that restarts in place, or one whose ranks are watched for hangs
    # and that nothing watches yet: the launcher runs the ranks.
    if (contract.RANK not in os.environ and os.environ.get(contract.PET_NPROC_PER_NODE)) or \
            os.environ.get(contract.GENERATION_FILE) or \
            (os.environ.get(contract.HANG, "off") != "off" and not os.environ.get(contract.HEARTBEAT_DIR)):
        from kubetrain.core.launcher import launch  # noqa: PLC0415

        return launch([sys.executable, "-m", "kubetrain.trainer"], standby=True)
    if os.environ.get(contract.STANDBY) and not await_generation():
        return 0
    # Not before: a launcher (a restarted container's, say) starts its ranks without the API models.
    from kubetrain.trainer.config import ConfigError, config_error, load_spec, read_env  # noqa: PLC0415
    from kubetrain.trainer.data.fetch import resolved  # noqa: PLC0415

    try:
        env = read_env()
        cache = os.environ.get(contract.CACHE_DIR)
        spec = resolved(load_spec(env.config_path), Path(cache) if cache else None)  # hfUri: the fetched copy
    except ConfigError as exc:
        return config_error(exc)
    from kubetrain.trainer.loop import train  # noqa: PLC0415 - torch import after config checks

    try:
        return train(env, spec)
    except ConfigError as exc:
        return config_error(exc)
    except Exception as exc:  # noqa: BLE001 - report and exit non-zero; the backend decides about restarts
        return crashed(exc)
    except BaseException as exc:
        if type(exc).__name__ != "CheckpointException":  # DCP's is a BaseException; KeyboardInterrupt is not ours
            raise
        return crashed(exc)


def crashed(exc: BaseException) -> int:
    """The exit code of a rank that raised `exc`: PEER_LOST_EXIT_CODE (at once, see below) when another rank
    went away mid-collective, else 1; the traceback goes to stderr."""
    traceback.print_exc()
    if peer_lost(exc):
        print(
            f"kubetrain.trainer: a collective failed because another rank went away; exiting "
            f"{contract.PEER_LOST_EXIT_CODE} (look for the first failure among the other ranks)",
            file=sys.stderr, flush=True,
        )
        sys.stdout.flush()
        # Skip interpreter teardown: the process group's threads abort it ("terminate called
        # without an active exception", exit 134), which would hide this exit code.
        os._exit(contract.PEER_LOST_EXIT_CODE)
    sys.stderr.flush()
    return 1


def await_generation() -> bool:
    """A standby rank (contract.STANDBY): import what training needs now, then wait for the launcher to
    say which generation to run. False when it says none (its stdin ends): it went another way."""
    import kubetrain.trainer.loop  # noqa: F401, PLC0415 - importing early is what a standby is for

    line = sys.stdin.readline().strip()
    if not line.isdigit():
        return False
    os.environ[contract.RESTART_GENERATION] = line
    del os.environ[contract.STANDBY]
    return True


_PEER_LOST_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "Socket Timeout",
    "Timed out waiting",
    "remote process exited",
)


def peer_lost(exc: BaseException) -> bool:
    """True when exc says another rank went away mid-collective (gloo/NCCL/store errors)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(exc, getattr(dist, "DistError", ())):
        return True
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: each rank's (exception, trace)
    if isinstance(failures, dict) and failures:
        return all(isinstance(f, tuple) and f and peer_lost(f[0]) for f in failures.values())
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in _PEER_LOST_MARKERS)


def _install_rank_filter() -> None:
    rank = os.environ.get(contract.RANK, "-")

    class _Rank(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.rank = rank
            return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(_Rank())
