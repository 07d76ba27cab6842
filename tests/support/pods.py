"""Waiting on a pod's phase and reading how its containers ended."""

from __future__ import annotations

from kubernetes import client

from .waiting import wait_for


def wait_pod_phase(
    core: client.CoreV1Api, namespace: str, name: str, phase: str, timeout: float = 30.0
) -> client.V1Pod:
    def reached() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase == phase else None

    return wait_for(reached, timeout, what=f"pod {namespace}/{name} phase {phase}")


def container_exit_codes(pod: client.V1Pod) -> dict[str, int]:
    """Exit codes of the pod's terminated containers, by container name."""
    codes: dict[str, int] = {}
    for status in pod.status.container_statuses or []:
        terminated = status.state.terminated if status.state else None
        if terminated is not None:
            codes[status.name] = terminated.exit_code
    return codes
