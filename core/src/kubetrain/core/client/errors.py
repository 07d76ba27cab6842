"""What the client raises: one base class, the API server's refusals by kind, and a job's failure.

An API server refusal keeps the server's own message (the `message` of its Status body), its
HTTP status and its reason (Forbidden, Invalid, AlreadyExists, NotFound, Conflict): callers
catch `Forbidden` or `NotFound`, never the HTTP client's ApiException, and a traceback never
shows the HTTP response dump.
"""

from __future__ import annotations

import json
from typing import Any


class ClientError(Exception):
    """Anything the client cannot do; the message says what and why in one line."""


class InvalidManifest(ClientError, ValueError):
    """The object failed the checks `kubetrain validate` makes; nothing was sent."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        super().__init__(f"{source}: " + "; ".join(problems))


class ApiError(ClientError):
    """The API server refused a request. `message` is its own words; `status` the HTTP status;
    `reason` its Status reason (e.g. AlreadyExists); `what` the request, as the client names it."""

    def __init__(self, what: str, message: str, status: int | None = None, reason: str = ""):
        self.what, self.message, self.status, self.reason = what, message, status, reason
        super().__init__(f"{what}: {message}" if status is None else f"{what}: {message} (HTTP {status})")


class Unauthorized(ApiError):
    """401: the credentials were not accepted (an expired token, a wrong kubeconfig user)."""


class Forbidden(ApiError):
    """403: RBAC (or an admission policy) refused this identity the request."""


class NotFound(ApiError):
    """404: no such object (or no such kind: the CRD is not installed)."""

    def __init__(self, what: str, message: str, status: int | None = 404, reason: str = "NotFound"):
        super().__init__(what, message, status, reason)
        self.args = (f"{what}: not found",)  # the line users have always seen; .message keeps the server's words


class Conflict(ApiError):
    """409: the object already exists, or changed since it was read."""


class Invalid(ApiError):
    """422: the API server's schema, CEL rules or an admission webhook refused the object."""


BY_STATUS: dict[int, type[ApiError]] = {401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict, 422: Invalid}


def server_message(body: Any, fallback: str) -> tuple[str, str]:
    """(message, reason) of an API server Status body (JSON text or bytes); the fallback when it is none."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not body:
        return fallback, ""
    try:
        status = json.loads(body)
    except ValueError:
        return str(body).strip() or fallback, ""
    if not isinstance(status, dict):
        return str(body).strip(), ""
    return str(status.get("message") or fallback), str(status.get("reason") or "")


def api_error(exc: Exception, what: str) -> ApiError:
    """The typed error for an exception of the kubernetes client (an ApiException has `status` and
    `body`; a connection error has neither: it becomes an ApiError with its own text)."""
    status = getattr(exc, "status", None)
    status = status if isinstance(status, int) and status > 0 else None
    message, reason = server_message(getattr(exc, "body", None), getattr(exc, "reason", None) or str(exc))
    kind = BY_STATUS.get(status or 0, ApiError)
    if kind is NotFound:
        return NotFound(what, message, status, reason or "NotFound")
    return kind(what, message, status, reason)


class JobFailed(ClientError):
    """`wait` saw the job (or sweep) fail. `reason` and `message` are its status's; `job` the object as last read."""

    def __init__(self, name: str, reason: str, message: str, job: Any = None):
        self.name, self.reason, self.message, self.job = name, reason, message, job
        super().__init__(f"{name} failed: {reason or 'no reason given'}" + (f": {message}" if message else ""))


class WaitTimeout(ClientError, TimeoutError):
    """`wait` ran out of time; `job` is the object as last read."""

    def __init__(self, name: str, until: str, timeout: float, phase: str, job: Any = None):
        self.name, self.until, self.timeout, self.phase, self.job = name, until, timeout, phase, job
        super().__init__(f"{name}: not {until} after {timeout:g}s (phase {phase})")
