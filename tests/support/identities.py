"""Who a test acts as: clients for a token or an impersonated user, ServiceAccounts with a
TokenRequest token (so authentication and RBAC are the API server's own), kubeconfigs for them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from kubernetes import client


def bearer_client(base: client.ApiClient, token: str) -> client.ApiClient:
    """A client for the same API server as ``base`` that authenticates with ``token`` only."""
    src = base.configuration
    cfg = client.Configuration()
    cfg.host = src.host
    cfg.ssl_ca_cert = src.ssl_ca_cert
    cfg.verify_ssl = src.verify_ssl
    cfg.api_key = {"authorization": token}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(cfg)


def impersonating_client(base: client.ApiClient, user: str, group: str | None = None) -> client.ApiClient:
    """A client that acts as ``user`` (optionally in ``group``) through impersonation by ``base``'s identity."""
    api = client.ApiClient(base.configuration)
    api.set_default_header("Impersonate-User", user)
    if group is not None:
        api.set_default_header("Impersonate-Group", group)
    return api


def token_for(admin: client.ApiClient, namespace: str, service_account: str, seconds: int = 3600) -> str:
    """A TokenRequest token of the ServiceAccount."""
    req = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=seconds))
    core = client.CoreV1Api(admin)
    return str(core.create_namespaced_service_account_token(service_account, namespace, req).status.token)


def token_kubeconfig(admin_kubeconfig: Path, token: str, path: Path) -> Path:
    """A kubeconfig for the same API server that authenticates with ``token`` only."""
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    ctx = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == ctx["cluster"])
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "test", "cluster": cluster["cluster"]}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "test", "user": "sa"}}],
    }))
    path.chmod(0o600)
    return path


@dataclass(frozen=True)
class Identity:
    """A ServiceAccount with its own token-authenticated client."""

    namespace: str
    name: str
    api: client.ApiClient

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.name}"


def service_account_identity(
    admin: client.ApiClient,
    namespace: str,
    name: str,
    rules: list[client.V1PolicyRule] | None = None,
    *,
    token_seconds: int = 3600,
) -> Identity:
    """Create ServiceAccount ``name`` (bound to a Role with ``rules`` if given) and log in as it."""
    core = client.CoreV1Api(admin)
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name)))
    if rules:
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_namespaced_role(namespace, client.V1Role(metadata=client.V1ObjectMeta(name=name), rules=rules))
        rbac.create_namespaced_role_binding(
            namespace,
            client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name=name),
                role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=name),
                subjects=[client.RbacV1Subject(kind="ServiceAccount", name=name, namespace=namespace)],
            ),
        )
    token = token_for(admin, namespace, name, token_seconds)
    return Identity(namespace=namespace, name=name, api=bearer_client(admin, token))
