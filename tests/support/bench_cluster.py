"""The set-up the operator benches share: the hack/ cluster up, this checkout's CRD applied, and a fresh
namespace whose pods go to the kwok nodes (never to the real node)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from kubernetes import client, config

from .cluster import cluster_running, cluster_up, kubeconfig_path
from .kubectl import kubectl
from .kwok import KWOK_NAMESPACE_ANNOTATIONS
from .resources import wait_default_service_account


def bench_namespace() -> tuple[client.CoreV1Api, client.CustomObjectsApi, str]:
    """The admin's core and custom-objects clients and the new namespace's name (the caller deletes it)."""
    if not cluster_running():
        cluster_up()
    os.environ["KUBECONFIG"] = str(kubeconfig_path())
    config.load_kube_config(str(kubeconfig_path()))
    core, custom = client.CoreV1Api(), client.CustomObjectsApi()
    subprocess.run([sys.executable, "-m", "kubetrain.core", "crd", "-o", "/tmp/kubetrain-crd.yaml"], check=True)
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "/tmp/kubetrain-crd.yaml")
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=ns, annotations=KWOK_NAMESPACE_ANNOTATIONS)))
    wait_default_service_account(core, ns, timeout=60)
    return core, custom, ns
