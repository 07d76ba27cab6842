"""The S3 API of the job's s3:// URIs (spec.s3), through s3fs: one file system's options and error rules.

checkpoint.uri (checkpoint/object_store.py), data.uri (stream.py), model.hfUri and data.tokenizerUri (fetch.py) all
reach the store this way. Errors that a restart cannot cure (no such bucket, credentials refused, no endpoint)
become a ConfigError naming the field: the gang exits 2 and the job fails with the message instead of
restarting into the same error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kubetrain.core.api import S3Spec
from kubetrain.trainer.config import ConfigError

log = logging.getLogger(__name__)

REQUEST_ATTEMPTS = 3
"""Attempts per request (botocore's and s3fs's retries alike): a store that is down fails the rank within
seconds instead of a retry storm; a restart of the gang is the retry that follows."""
CONNECT_TIMEOUT_SECONDS = 10
FIRST_CONTACT_SECONDS = 120.0
"""How long a rank's first request to the store keeps trying while the store cannot be reached: a store or
network that is down for a minute costs a wait, an endpoint nothing answers on fails the job after it."""
_MISADDRESSED = ("NoCredentialsError", "InvalidEndpointError", "NoRegionError", "ParamValidationError")
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError")


def s3_options(s3: S3Spec | None) -> dict[str, Any]:
    """S3FileSystem's keyword arguments for spec.s3. Credentials are left to botocore's default chain
    (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY from the Secret, the pod's web identity, ~/.aws)."""
    s3 = s3 or S3Spec()
    client: dict[str, Any] = {"region_name": s3.region} if s3.region else {}
    return {
        "endpoint_url": s3.endpoint,
        "client_kwargs": client,
        "config_kwargs": {
            "s3": {"addressing_style": s3.style()},
            "connect_timeout": CONNECT_TIMEOUT_SECONDS,
            "retries": {"max_attempts": REQUEST_ATTEMPTS, "mode": "standard"},
        },
        "use_listings_cache": False,  # other ranks and processes write: every listing must be the store's
        "skip_instance_cache": True,
    }


def file_system(s3: S3Spec | None, field: str) -> Any:
    """An S3FileSystem for spec.s3; without s3fs in the image, a ConfigError naming ``field``."""
    try:
        import s3fs  # noqa: PLC0415 - only jobs with an s3:// URI need it
    except ImportError as exc:
        raise ConfigError(field, "needs s3fs in the trainer image (pip install 'kubetrain-trainer[s3]')") from exc
    fs = s3fs.S3FileSystem(**s3_options(s3))
    fs.retries = REQUEST_ATTEMPTS
    return fs


def store_error(exc: BaseException, field: str, uri: str, *, first_contact: bool = False) -> ConfigError | None:
    """The ConfigError naming ``field`` and ``uri`` for an error no restart cures, or None (a transient one: the
    gang restarts). A store that cannot be reached counts as misaddressed only at ``first_contact`` (after
    FIRST_CONTACT_SECONDS of tries): once reached, losing it is an outage that a restart outlives."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    kind = type(exc).__name__
    if isinstance(exc, PermissionError):
        why = "the credentials were refused (s3.credentialsSecret, or the pod's cloud identity)"
    elif isinstance(exc, FileNotFoundError) and "bucket" in text.lower():
        why = "the bucket does not exist"
    elif kind in _MISADDRESSED or (first_contact and kind in _UNREACHABLE):
        why = "the store cannot be reached or addressed (s3.endpoint, s3.region)"
    else:
        return None
    return ConfigError(field, f"{uri}: {why}: {kind}: {text}")


def bucket_of(uri: str) -> str:
    """``s3://bucket/prefix`` -> ``bucket``."""
    return uri.split("://", 1)[1].split("/", 1)[0]


def require_bucket(fs: Any, field: str, uri: str, *, wait_s: float = FIRST_CONTACT_SECONDS,
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """The URI's bucket exists and these credentials reach it (S3's HeadBucket), else a ConfigError naming
    ``field``. Asked before any write: some stores (SeaweedFS) create a missing bucket on its first write
    instead of refusing it, and a job would then write to a bucket nobody meant. While the store cannot be
    reached, asked again for up to ``wait_s``."""
    deadline = clock() + wait_s
    while True:
        try:
            fs.call_s3("head_bucket", Bucket=bucket_of(uri))
            return
        except FileNotFoundError as exc:
            raise ConfigError(field, f"{uri}: the bucket does not exist: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            left = deadline - clock()
            if type(exc).__name__ not in _UNREACHABLE or left <= 0:
                config = store_error(exc, field, uri, first_contact=True)
                raise (config or ConfigError(field, f"{uri}: {type(exc).__name__}: {exc}")) from exc
            log.warning("%s: %s: the store cannot be reached yet (%s); asking again for up to %.0f s",
                        field, uri, type(exc).__name__, left)
            sleep(min(5.0, left))


def call(field: str, uri: str, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) against the store; an error no restart cures becomes a ConfigError naming ``field``
    and ``uri``, any other a RuntimeError saying ``what`` failed (the gang restarts)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if (config := store_error(exc, field, uri)) is not None:
            raise config from exc
        raise RuntimeError(f"{uri}: {what} failed: {type(exc).__name__}: {exc}") from exc


def list_under(fs: Any, field: str, uri: str) -> dict[str, dict[str, Any]]:
    """Every object under ``uri`` (its bucket asked for first): key without the scheme -> s3fs's details."""
    require_bucket(fs, field, uri)
    found: dict[str, dict[str, Any]] = call(field, uri, "listing", fs.find, uri.split("://", 1)[1].rstrip("/"),
                                            detail=True)
    return found
