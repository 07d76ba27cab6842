"""TrainingJobs of one namespace through the admin client: the calls operator tests make, and
waiting on a job's status with what explains a timeout in the failure message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client

from kubetrain.core import api, contract

from .operator_process import OperatorProcess
from .waiting import wait_for

StatusCheck = Callable[[dict[str, Any]], Any]


class TrainingJobs:
    """``op``: the operator that runs them, whose log tail goes into failure messages."""

    def __init__(self, admin_api: client.ApiClient, namespace: str, op: OperatorProcess | None = None):
        self.custom = client.CustomObjectsApi(admin_api)
        self.core = client.CoreV1Api(admin_api)
        self.ns = namespace
        self.op = op

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self.custom.create_namespaced_custom_object(api.GROUP, api.VERSION, self.ns, api.PLURAL, body))

    def get(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, self.ns, api.PLURAL, name))

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.get(name).get("status") or {})

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(api.GROUP, api.VERSION, self.ns, api.PLURAL, name, {"spec": spec})

    def pods(self, name: str) -> list[client.V1Pod]:
        return list(self.core.list_namespaced_pod(self.ns, label_selector=f"{contract.LABEL_JOB}={name}").items)

    def events(self, name: str) -> list[client.CoreV1Event]:
        evs = self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={name}").items
        return [e for e in evs if e.involved_object.kind == api.KIND]

    def wait_status(self, name: str, check: StatusCheck, timeout: float = 60, what: str = "", *,
                    interval: float = 0.1) -> dict[str, Any]:
        """The job's status once ``check(status)`` is truthy; on timeout the failure's first line (all that a CI
        summary shows) ends with ``headline``, and the lines after it say what ``explain`` does."""
        try:
            return wait_for(lambda: (s := self.status(name)) and check(s) and s, timeout, what=what or name,
                            interval=interval)
        except AssertionError as exc:
            raise AssertionError(f"{exc} | {self.headline(name)}\n{self.explain(name)}") from exc

    def headline(self, name: str) -> str:
        """The job's phase, restarts and message in one line."""
        st = self.status(name)
        return " ".join(f"{k}={st.get(k)}" for k in ("phase", "restartCount", "failures", "message") if st.get(k))

    def explain(self, name: str) -> str:
        """The job's status and the operator's log tail, for failure messages."""
        text = f"status: {self.status(name)}"
        return f"{text}\noperator log:\n{self.op.tail()}" if self.op else text
