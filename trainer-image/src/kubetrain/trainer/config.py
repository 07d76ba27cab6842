"""Reading the worker environment contract and the job's trainer config.

Configuration problems raise :class:`ConfigError`, which the entrypoint turns into
exit code 2 (a permanent failure the backends do not retry) with a message that
names the offending field.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from kubetrain.core import __version__, contract, hangs
from kubetrain.core.api import DAEMON_IMAGE_RULE, TrainingJobSpec

DEFAULT_DIST_TIMEOUT_SECONDS = 600.0


class ConfigError(Exception):
    """A bad job config or environment; ``field`` names what to fix (camelCase spec path or env var)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Env:
    """This process's place in the gang and kubetrain's own variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    config_path: Path
    checkpoint_dir: Path | None
    output_dir: Path | None
    job: str
    generation: int
    metrics_port: int | None
    fail_at: tuple[int, int] | None
    dist_timeout: timedelta
    metrics_addr: str = "0.0.0.0"
    """Where the metrics endpoint binds (contract.METRICS_ADDR; loopback in a local run)."""
    run: str = ""
    """contract.RUN_ID: with `generation`, the gang's claim on the checkpoints (empty: not fenced)."""


def _int_env(environ: dict[str, str] | os._Environ[str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(name, "environment variable is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(name, f"must be an integer, got {raw!r}") from None


def parse_fail_at(raw: str | None) -> tuple[int, int] | None:
    """``"RANK:STEP"`` -> (rank, step); empty -> None."""
    if not raw:
        return None
    parts = raw.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        return int(parts[0]), int(parts[1])
    except ValueError:
        raise ConfigError(contract.FAIL_AT, f"must be RANK:STEP, got {raw!r}") from None


def collective_timeout(hang: str | None) -> float:
    """Past hang detection's every limit where it is on (it answers first, with stacks), else torch's 600 s."""
    limits = hangs.Limits.decode(hang)
    return limits.collective_timeout() if limits is not None else DEFAULT_DIST_TIMEOUT_SECONDS


def read_env(environ: dict[str, str] | os._Environ[str] | None = None) -> Env:
    e = os.environ if environ is None else environ
    rank = _int_env(e, contract.RANK)
    world_size = _int_env(e, contract.WORLD_SIZE, 1)
    if not 0 <= rank < world_size:
        raise ConfigError(contract.RANK, f"{rank} is outside WORLD_SIZE {world_size}")
    config = e.get(contract.CONFIG)
    if not config:
        raise ConfigError(contract.CONFIG, "environment variable is not set (path of the trainer config JSON)")
    ckpt = e.get(contract.CHECKPOINT_DIR)
    out = e.get(contract.OUTPUT_DIR)
    port = e.get(contract.METRICS_PORT)
    try:
        timeout = float(e.get(contract.DIST_TIMEOUT) or collective_timeout(e.get(contract.HANG)))
    except ValueError:
        raise ConfigError(contract.DIST_TIMEOUT, "must be a number of seconds") from None
    return Env(
        rank=rank,
        world_size=world_size,
        local_rank=_int_env(e, contract.LOCAL_RANK, 0),
        master_addr=e.get(contract.MASTER_ADDR) or "127.0.0.1",
        master_port=_int_env(e, contract.MASTER_PORT, contract.DEFAULT_MASTER_PORT),
        config_path=Path(config),
        checkpoint_dir=Path(ckpt) if ckpt else None,
        output_dir=Path(out) if out else None,
        job=e.get(contract.JOB) or "",
        generation=_int_env(e, contract.RESTART_GENERATION, 0),
        metrics_port=int(port) if port and port.isdigit() and int(port) > 0 else None,
        metrics_addr=e.get(contract.METRICS_ADDR) or "0.0.0.0",
        run=e.get(contract.RUN_ID) or "",
        fail_at=parse_fail_at(e.get(contract.FAIL_AT)),
        dist_timeout=timedelta(seconds=timeout),
    )


def _loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(root)"


def _explain(error: ErrorDetails) -> str:
    if error["type"] != "extra_forbidden":
        return str(error["msg"])
    # The operator writes only the fields a job sets, so an unknown one comes from a newer operator
    # (the API server checked the spelling) or from a config written by hand.
    return (f"unknown to this trainer image (kubetrain {__version__}): set by a newer operator (run a trainer "
            "image of the operator's version, or leave the field unset) or misspelled")


def load_spec(path: Path) -> TrainingJobSpec:
    """The TrainingJobSpec in wire form (camelCase JSON); every problem names its field."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(contract.CONFIG, f"config file {path} does not exist") from None
    except ValueError as exc:
        raise ConfigError(contract.CONFIG, f"config file {path} is not valid JSON: {exc}") from None
    if isinstance(raw, dict) and "spec" in raw and isinstance(raw["spec"], dict) and "kind" in raw:
        raw = raw["spec"]  # a whole TrainingJob is accepted too
    try:
        spec = TrainingJobSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(_loc(first["loc"]), f"{_explain(first)}{more}") from None
    # A fabric's daemon image in the config came from the job's runtime (a job may not name one): no trainer concern.
    violations = [v for v in spec.rule_violations() if v[0] != DAEMON_IMAGE_RULE.path]
    if violations:
        field, message = violations[0]
        raise ConfigError(field, message)
    return spec


def checkpoint_dir(spec: TrainingJobSpec, env: Env) -> Path:
    if spec.checkpoint.dir:
        return Path(spec.checkpoint.dir)
    if env.checkpoint_dir is not None:
        return env.checkpoint_dir
    if env.output_dir is not None:
        return env.output_dir / "checkpoints"
    raise ConfigError("checkpoint.dir", f"not set and {contract.CHECKPOINT_DIR} is not set either")


def config_error(exc: Exception) -> int:
    """Exit CONFIG_ERROR_EXIT_CODE; the message (the field and the reason) goes to stderr and, in a pod, to the
    termination message, which the operator puts in the job's status and Events."""
    from kubetrain.core.launcher import termination_message  # noqa: PLC0415

    print(f"kubetrain.trainer: {contract.CONFIG_ERROR_PREFIX}{exc}", file=sys.stderr, flush=True)
    termination_message(f"{contract.CONFIG_ERROR_PREFIX}{exc}")
    return contract.CONFIG_ERROR_EXIT_CODE
