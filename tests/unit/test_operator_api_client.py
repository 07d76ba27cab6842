"""The operator's kubernetes client (handlers._api_client): its connections, what each call costs, and the
throttled answers it waits on."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import pytest
from kubernetes import client
from kubernetes.client import configuration
from kubernetes.client.rest import ApiException
from kubernetes.config import kube_config

from kubetrain.operator import handlers
from kubetrain.operator.jobs.apply import API_TIMEOUT, Unvalidated
from kubetrain.operator.runtime.objects import MAX_RETRY_AFTER, retry_after

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: secret}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.fixture
def from_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client configured from a kubeconfig with a static token (not in a pod)."""
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    # Loading sets the process's default configuration: the other tests get theirs back.
    monkeypatch.setattr(configuration.Configuration, "_default", configuration.Configuration._default)


def test_the_proxy_is_read_from_the_environment_once_not_before_every_call(
        from_kubeconfig: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("https_proxy", "http://proxy.internal:3128")
    api_client = handlers._api_client(4)
    assert api_client.configuration.proxy == "http://proxy.internal:3128"
    assert api_client.configuration.connection_pool_maxsize >= 4

    def environment_read() -> NoReturn:
        raise AssertionError("a call read the proxy environment again")

    monkeypatch.setattr(configuration, "getproxies", environment_read, raising=False)  # 36 reads it only at init
    sent: dict[str, Any] = {}

    def request(method: str, url: str, headers: dict[str, str], **_: Any) -> Any:  # urllib3's, under the client
        sent.update(url=url, headers=headers)
        return SimpleNamespace(status=200, reason="", data=b"{}", headers={}, getheaders=dict)

    api_client.rest_client.pool_manager.request = request
    client.CoreApi(api_client).get_api_versions(_preload_content=False)
    assert sent["url"] == "https://127.0.0.1:6443/api/" and sent["headers"]["authorization"] == "Bearer secret"
    assert api_client.configuration.proxy == "http://proxy.internal:3128"


def test_retry_after_is_read_from_a_throttled_answer_only() -> None:
    def answer(status: int, headers: dict[str, str] | None = None) -> ApiException:
        exc = ApiException(status=status)
        exc.headers = headers
        return exc

    assert retry_after(answer(429, {"Retry-After": "7"})) == 7.0
    assert retry_after(answer(503, {"Retry-After": "1"})) == 1.0
    assert retry_after(answer(429, {"Retry-After": "86400"})) == MAX_RETRY_AFTER
    assert retry_after(answer(429, {"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"})) is None
    assert retry_after(answer(429)) is None  # no header: the backoff applies
    assert retry_after(answer(500, {"Retry-After": "7"})) is None
    assert retry_after(RuntimeError("no answer at all")) is None


def test_every_call_through_the_applier_has_a_deadline_unless_it_sets_its_own() -> None:
    api_client = client.ApiClient()
    seen: list[Any] = []

    def call_api(*args: Any, **kwargs: Any) -> NoReturn:
        seen.append(kwargs.get("_request_timeout"))
        raise ConnectionError("no API server here")

    api_client.call_api = call_api  # type: ignore[method-assign]
    core = Unvalidated(client.CoreV1Api(api_client))
    for timeout in ({}, {"_request_timeout": (1, 2)}):
        with pytest.raises(ConnectionError):
            core.read_namespaced_pod("p", "ns", **timeout)
    assert seen == [API_TIMEOUT, (1, 2)]
