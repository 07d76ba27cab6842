"""The Helm chart: CRD in sync with crds/, lint/template for defaults, presets and ci values,
the security settings and the RBAC the rendered objects carry, dashboards and values docs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import helm_tool as ht
from support.paths import CHART
from support.paths import REPO_ROOT as REPO

from kubetrain.core import contract
from kubetrain.core.pod_template import BASELINE_CAPABILITIES
from kubetrain.operator.jobs.fabrics import FABRICS

VALUES_SETS = [pytest.param([], id="defaults")] + [pytest.param([f], id=f"{f.parent.name}/{f.name}")
                                                    for f in ht.PRESETS + ht.CI_VALUES]


def test_chart_crd_is_identical_to_crds_dir() -> None:
    ours = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert ours == sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    for name in ours:
        assert (CHART / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes(), (
            f"charts/kubetrain/crds/{name} differs from crds/{name}: cp crds/{name} charts/kubetrain/crds/ "
            "(`make crds` does both)"
        )


def test_presets_exist_for_each_cloud() -> None:
    assert {p.name for p in ht.PRESETS} == {"eks-efa.yaml", "gke.yaml", "aks-infiniband.yaml"}
    for p in ht.PRESETS:
        assert p.read_text().startswith("# "), f"{p.name} must start with its documentation"


@pytest.mark.parametrize("values", VALUES_SETS)
def test_lint_and_template(helm_ok: None, values: list[Path]) -> None:
    args = ht.value_args(values)
    lint = ht.helm("lint", "--strict", str(CHART), *args)
    assert "0 chart(s) failed" in lint.stdout
    docs = ht.render(values)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds
    _check_deployment(ht.find(docs, "Deployment"))
    for d in docs:
        if d["kind"] in ("ClusterRole", "Role"):
            _check_no_secrets(d)


def _check_deployment(dep: dict[str, Any]) -> None:
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    health = next(p for p in c["ports"] if p["name"] == "health")["containerPort"]
    assert f"--liveness=http://0.0.0.0:{health}/healthz" in c["args"]


def _check_no_secrets(role: dict[str, Any]) -> None:
    for rule in role["rules"]:
        assert "secrets" not in rule.get("resources", []), rule
        assert "*" not in rule.get("resources", []) and "*" not in rule["verbs"], rule
        assert "*" not in rule.get("apiGroups", []), rule


def test_leader_election_with_replicas(helm_ok: None) -> None:
    one = ht.render()
    assert not any(a.startswith("--leader-elect") for a in ht.find(one, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"])
    assert ht.find(one, "Deployment")["spec"]["strategy"]["type"] == "Recreate"
    # Without leader election, the only Lease access is reading the nodes' (a gang that lost its peers).
    assert [(d["metadata"]["name"], d["metadata"]["namespace"], d["rules"]) for d in one if d["kind"] == "Role"] == [
        ("kubetrain-node-leases", "kube-node-lease",
         [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get"]}])]
    two = ht.render(set_values={"operator.replicas": 2}, namespace="ops")
    container = ht.find(two, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"--leader-elect", "--leader-elect-lease=kubetrain-operator", "--leader-elect-namespace=ops"} <= set(container["args"])
    assert "strategy" not in ht.find(two, "Deployment")["spec"]  # rolling: the standby holds on during a rollout
    # The Lease only: create (names are unknown before creation), get/update of that one name, in the release namespace.
    role = ht.find(two, "Role", "kubetrain-leader-election")
    assert role["metadata"]["namespace"] == "ops"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["kubetrain-operator"],
         "verbs": ["get", "update"]},
    ]
    binding = ht.find(two, "RoleBinding", "kubetrain-leader-election")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert not [d for d in two if d["kind"] == "CustomResourceDefinition" and "kopf" in d["metadata"]["name"]]


def test_the_user_roles_aggregate_into_kubernetes_own_and_can_be_left_out(helm_ok: None) -> None:
    docs = ht.render()
    edit, view = ht.find(docs, "ClusterRole", "kubetrain-edit"), ht.find(docs, "ClusterRole", "kubetrain-view")
    assert {k for k, v in edit["metadata"]["labels"].items() if v == "true"} == {
        "rbac.authorization.k8s.io/aggregate-to-edit", "rbac.authorization.k8s.io/aggregate-to-admin"}
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {v for r in view["rules"] for v in r["verbs"]} == {"get", "list", "watch"}
    assert "create" in edit["rules"][0]["verbs"] and "secrets" not in str(edit["rules"])
    off = ht.render(set_values={"rbac.userRoles": False})
    assert [d["metadata"]["name"] for d in off if d["kind"] == "ClusterRole"] == ["kubetrain"]


def test_namespaced_mode(helm_ok: None) -> None:
    docs = ht.render(set_values={"rbac.scope": "namespaced", "rbac.watchNamespace": "ml"})
    role = ht.find(docs, "Role", "kubetrain")
    assert role["metadata"]["namespace"] == "ml"
    assert any("pods" in r["resources"] for r in role["rules"])
    cluster_resources = {res for r in ht.find(docs, "ClusterRole", "kubetrain")["rules"] for res in r["resources"]}
    # Cluster-scoped reads only: Kueue's flavors, the priority classes a Workload's priority comes from, and the
    # cluster-wide runtimes jobs reference, the StorageClasses of their checkpoint claims.
    assert cluster_resources == {"nodes", "customresourcedefinitions", "namespaces", "resourceflavors",
                                 "workloadpriorityclasses", "priorityclasses", "clustertrainingruntimes",
                                 "storageclasses"}
    assert {v for r in ht.find(docs, "ClusterRole", "kubetrain")["rules"] if "resourceflavors" in r["resources"] for v in r["verbs"]} == {"get"}
    assert any("workloads" in r["resources"] for r in role["rules"])
    off = ht.render(set_values={"rbac.scope": "namespaced", "rbac.watchNamespace": "ml", "rbac.kueue": False})
    kinds = {res for doc in off if doc["kind"] in ("Role", "ClusterRole") for r in doc["rules"] for res in r["resources"]}
    assert not kinds & {"workloads", "workloads/status", "resourceflavors", "workloadpriorityclasses"}
    assert ht.find(docs, "RoleBinding", "kubetrain")["subjects"][0]["namespace"] == "kubetrain"
    assert "--namespace=ml" in ht.find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]


def test_namespaced_mode_watches_each_listed_namespace(helm_ok: None) -> None:
    docs = ht.render(set_values={"rbac.scope": "namespaced", "rbac.watchNamespaces": ["team-a", "team-b", "team-a"]})
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kubetrain"}
    bindings = {d["metadata"]["namespace"]: d for d in docs
                if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "kubetrain"}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}  # one each, the duplicate once
    assert roles["team-a"]["rules"] == roles["team-b"]["rules"] and any("pods" in r["resources"]
                                                                      for r in roles["team-b"]["rules"])
    for binding in bindings.values():
        assert binding["roleRef"]["name"] == "kubetrain" and binding["subjects"][0]["namespace"] == "kubetrain"
    args = ht.find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a,team-b"]
    for name in ("kubetrain-admission", "kubetrain-worker-pods"):
        selector = ht.find(docs, "ValidatingAdmissionPolicyBinding", name)["spec"]["matchResources"]
        assert selector["namespaceSelector"]["matchExpressions"] == [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]
    default = ht.render(set_values={"rbac.scope": "namespaced"}, namespace="ops")  # neither set: the release's
    assert [d["metadata"]["namespace"] for d in default if d["kind"] == "Role" and d["metadata"]["name"] == "kubetrain"] \
        == ["ops"]
    both = ht.helm("template", "x", str(CHART), *ht.value_args(set_values={
        "rbac.scope": "namespaced", "rbac.watchNamespace": "ml", "rbac.watchNamespaces": ["a"]}), check=False)
    assert both.returncode != 0 and "both set" in both.stderr
    bad = ht.helm("template", "x", str(CHART), *ht.value_args(set_values={"rbac.watchNamespaces": ["ml-*"]}),
                  check=False)
    assert bad.returncode != 0 and "watchNamespaces" in bad.stderr


def test_schema_rejects_bad_values(helm_ok: None) -> None:
    bad = ht.helm("template", "x", str(CHART), "--set", "rbac.scope=everything", check=False)
    assert bad.returncode != 0 and "rbac" in bad.stderr
    typo = ht.helm("template", "x", str(CHART), "--set", "operator.replica=2", check=False)
    assert typo.returncode != 0 and "replica" in typo.stderr


def test_worker_series_are_labelled_from_their_pods_and_monitors_carry_the_release_label(helm_ok: None) -> None:
    """A tenant's worker cannot label its series as another job's or namespace's: honorLabels off, job from the
    pod's kubetrain.io/job-name; the operator's per-job series keep their namespace; `release` where asked."""
    docs = ht.render([CHART / "ci" / "all-on-values.yaml"], set_values={"metrics.release": "kps"})
    pm, sm, rule = (ht.find(docs, kind) for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule"))
    assert pm["spec"]["jobLabel"] == contract.LABEL_JOB
    assert pm["spec"]["podMetricsEndpoints"][0]["honorLabels"] is False
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    assert [d["metadata"]["labels"]["release"] for d in (pm, sm, rule)] == ["kps"] * 3
    plain = ht.render([CHART / "ci" / "all-on-values.yaml"])
    assert "release" not in ht.find(plain, "PodMonitor")["metadata"]["labels"]


def test_every_job_alert_names_the_namespace_and_the_job(helm_ok: None) -> None:
    rules = {r["alert"]: r["expr"] for g in ht.alert_rules()["groups"] for r in g["rules"]}
    for alert in ("KubetrainJobFailed", "KubetrainRestartStorm", "KubetrainJobNoProgress"):
        assert "by (namespace, trainingjob" in rules[alert], alert


def test_monitoring_objects(helm_ok: None) -> None:
    docs = ht.render([CHART / "ci" / "all-on-values.yaml"])
    pm = ht.find(docs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == {"kubetrain.io/role": "worker"}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    sm = ht.find(docs, "ServiceMonitor")
    svc = ht.find(docs, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["name"] == sm["spec"]["endpoints"][0]["port"] == "metrics"
    cm = ht.find(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (payload,) = cm["data"].values()
    assert json.loads(payload) == json.loads((CHART / "dashboards" / "kubetrain-overview.json").read_text())
    np = ht.find(docs, "NetworkPolicy")
    assert np["spec"]["podSelector"]["matchLabels"] == ht.find(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    gke = ht.render([CHART / "presets" / "gke.yaml"])
    assert {"PodMonitoring", "ClusterPodMonitoring"} <= {d["kind"] for d in gke}
    aks = ht.render([CHART / "presets" / "aks-infiniband.yaml"])
    assert ht.find(aks, "PodMonitor")["apiVersion"] == "azmonitoring.coreos.com/v1"


def _metric_names(module: Path) -> set[str]:
    return set(re.findall(r'"(kubetrain_(?:operator|trainer)_[a-z_]+)"', module.read_text()))


def test_dashboard_queries_use_exported_metrics() -> None:
    known = _metric_names(REPO / "operator/src/kubetrain/operator/runtime/metrics.py") | _metric_names(
        REPO / "trainer-image/src/kubetrain/trainer/observe/metrics.py")
    dashboards = sorted((CHART / "dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        dash = json.loads(path.read_text())
        panels = [p for p in dash["panels"] if p["type"] != "row"]
        assert panels
        for p in panels:
            assert p["targets"], p["title"]
            for t in p["targets"]:
                for name in re.findall(r"kubetrain_[a-z_]+", t["expr"]):
                    base = re.sub(r"_(bucket|count|sum|total)$", "", name)
                    assert name in known or base in known, f"{path.name}: {p['title']}: unknown metric {name}"


# Values documented as one row (their sub-keys are Kubernetes fields or free-form labels).
OPAQUE = ("operator.resources", "operator.livenessProbe", "operator.readinessProbe", "dashboards.labels")


def _leaf_keys(d: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in OPAQUE:
            out += _leaf_keys(v, key + ".")
        else:
            out.append(key)
    return out


def test_readme_documents_every_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    missing = [k for k in _leaf_keys(values) if f"`{k}`" not in readme]
    assert not missing, f"charts/kubetrain/README.md does not document: {missing}"
    schema = json.loads((CHART / "values.schema.json").read_text())

    def in_schema(key: str) -> bool:
        node = schema
        for part in key.split("."):
            props = node.get("properties", {})
            if part not in props:
                return node.get("additionalProperties") not in (False, None)
            node = props[part]
        return True

    assert [k for k in _leaf_keys(values) if not in_schema(k)] == []


def _allows(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(group in r.get("apiGroups", []) and resource in r.get("resources", []) and verb in r["verbs"]
               and not r.get("resourceNames") for r in rules)


@pytest.mark.parametrize("scope", ["cluster", "namespaced"])
def test_operator_may_create_the_per_job_progress_rbac(helm_ok: None, scope: str) -> None:
    """The operator creates Role + RoleBinding <job>-progress; the API server accepts them only if the
    operator itself holds every permission they grant (no escalate/bind verbs for that)."""
    from kubetrain.core.api import TrainingJob  # noqa: PLC0415
    from kubetrain.operator.jobs import builders as b  # noqa: PLC0415

    docs = ht.render(set_values={"rbac.scope": scope})
    rules = (ht.find(docs, "Role", "kubetrain") if scope == "namespaced" else ht.find(docs, "ClusterRole", "kubetrain"))["rules"]
    for resource in ("roles", "rolebindings"):
        assert _allows(rules, "rbac.authorization.k8s.io", resource, "create")
    job = TrainingJob.model_validate({"metadata": {"name": "j", "namespace": "ns"}})
    role = b.progress_role(job)
    assert role is not None
    for granted in role["rules"]:
        for group in granted["apiGroups"]:
            for resource in granted["resources"]:
                for verb in granted["verbs"]:
                    assert _allows(rules, group, resource, verb), f"the operator lacks {verb} {resource}"
    assert not any(v in r["verbs"] for r in rules for v in ("escalate", "bind", "impersonate"))


@pytest.mark.parametrize("scope", ["cluster", "namespaced"])
def test_operator_may_run_sweeps(helm_ok: None, scope: str) -> None:
    """The sweep controller watches TrainingSweeps, writes their status, creates their trial TrainingJobs,
    suspends pruned ones (patch) and records Events; in the same object as the job rights, per scope."""
    docs = ht.render(set_values={"rbac.scope": scope})
    rules = (ht.find(docs, "Role", "kubetrain") if scope == "namespaced" else ht.find(docs, "ClusterRole", "kubetrain"))["rules"]
    wanted = {("kubetrain.io", "trainingsweeps"): ("get", "list", "watch"),
              ("kubetrain.io", "trainingsweeps/status"): ("get", "patch"),
              ("kubetrain.io", "trainingjobs"): ("create", "patch"),
              ("", "events"): ("create",)}
    for (group, resource), verbs in wanted.items():
        for verb in verbs:
            assert _allows(rules, group, resource, verb), f"{scope}: the operator lacks {verb} {resource}"
    assert not _allows(rules, "kubetrain.io", "trainingsweeps", "delete"), "the operator never deletes a sweep"
    assert not _allows(rules, "kubetrain.io", "trainingsweeps", "create")


def _operator_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in ht.find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("scope", ["cluster", "namespaced"])
def test_the_worker_network_policy_reaches_the_operator_with_the_rbac_to_make_it(helm_ok: None, scope: str) -> None:
    """workerNetworkPolicy: the operator makes each job's NetworkPolicy (no Helm object for it), so the value
    goes into its env and, only when on, get/create on networkpolicies into its RBAC in either scope."""
    from kubetrain.operator.runtime.settings import (  # noqa: PLC0415
        ENV_WORKER_NETWORK_POLICY,
        WorkerNetworkPolicy,
        worker_network_policy,
    )

    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    kind, name = ("Role", "kubetrain") if scope == "namespaced" else ("ClusterRole", "kubetrain")
    off = ht.render(set_values={"rbac.scope": scope})
    assert worker_network_policy(_operator_env(off)[ENV_WORKER_NETWORK_POLICY]) is None
    assert not any("networkpolicies" in r["resources"] for r in ht.find(off, kind, name)["rules"])
    on = ht.render(set_values={"rbac.scope": scope, "workerNetworkPolicy.enabled": True,
                               "workerNetworkPolicy.metricsFrom": [monitoring]})
    assert worker_network_policy(_operator_env(on)[ENV_WORKER_NETWORK_POLICY]) == WorkerNetworkPolicy((monitoring,))
    rules = ht.find(on, kind, name)["rules"]
    for verb in ("get", "create"):
        assert _allows(rules, "networking.k8s.io", "networkpolicies", verb), f"{scope}: the operator lacks {verb}"
    assert not _allows(rules, "networking.k8s.io", "networkpolicies", "delete")  # the garbage collector's
    assert [d["metadata"]["name"] for d in on if d["kind"] == "NetworkPolicy"] == []  # the operator's, per job
    bad = ht.helm("template", "x", str(CHART), *ht.value_args(set_values={
        "workerNetworkPolicy.metricsFrom": [{"namespace": "monitoring"}]}), check=False)
    assert bad.returncode != 0 and "namespace" in bad.stderr


def test_dashboard_has_a_sweeps_row() -> None:
    panels = json.loads((CHART / "dashboards" / "kubetrain-overview.json").read_text())["panels"]
    titles = [p["title"] for p in panels]
    row = titles.index("Sweeps")
    assert panels[row]["type"] == "row"
    end = next((i for i in range(row + 1, len(panels)) if panels[i]["type"] == "row"), len(panels))
    sweeps = panels[row + 1:end]
    exprs = [t["expr"] for p in sweeps for t in p["targets"]]
    assert any("kubetrain_operator_sweep_best_value" in e and "sweep" in e for e in exprs)
    assert any("kubetrain_operator_sweep_trials" in e and "state" in e for e in exprs)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"


def test_dashboard_has_a_goodput_row_filtered_by_namespace_and_job() -> None:
    dash = json.loads((CHART / "dashboards" / "kubetrain-overview.json").read_text())
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "namespace", "job"]
    panels = dash["panels"]
    row = [p["title"] for p in panels].index("Goodput")
    exprs = [t["expr"] for p in panels[row + 1:] for t in p.get("targets", [])]
    assert any("kubetrain_operator_job_goodput_seconds" in e and '$namespace' in e and '$job' in e for e in exprs)
    assert any("kubetrain_operator_job_steps_lost" in e for e in exprs)
    assert any("kubetrain_operator_time_to_first_step_seconds_bucket" in e for e in exprs)


def test_every_training_panel_filters_by_namespace_and_keeps_same_named_jobs_apart() -> None:
    dash = json.loads((CHART / "dashboards" / "kubetrain-overview.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", []) if "kubetrain_trainer_" in t["expr"]]
    assert len(exprs) >= 8
    for expr in exprs:
        assert 'namespace=~"$namespace"' in expr and "by (namespace, job" in expr, expr


def test_dashboard_gpu_row_joins_dcgm_to_the_jobs_worker_pods() -> None:
    panels = json.loads((CHART / "dashboards" / "kubetrain-overview.json").read_text())["panels"]
    row = [p["title"] for p in panels].index("GPUs")
    exprs = [t["expr"] for p in panels[row + 1:] for t in p.get("targets", [])]
    for metric in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_XID_ERRORS"):
        assert any(metric in e and 'pod=~"($job)-worker-[0-9]+"' in e and "$namespace" in e for e in exprs), metric
    assert any("kubetrain_trainer_device_memory_bytes" in e for e in exprs)


def _policy_messages(docs: list[dict[str, Any]]) -> str:
    policy = ht.find(docs, "ValidatingAdmissionPolicy", "kubetrain-admission")
    return " ".join(v["messageExpression"] for v in policy["spec"]["validations"])


def test_the_pod_policy_reaches_the_operator_and_the_api_server_alike(helm_ok: None) -> None:
    """podPolicy's allowances leave the admission policy's checks out exactly as the operator's env lets them."""
    docs = ht.render()
    env = {e["name"]: e.get("value") for e in ht.find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env["KUBETRAIN_POD_POLICY"]) == {"allowPrivileged": False, "allowHostPath": False,
                                                       "allowHostNamespaces": False, "allowedCapabilities": [],
                                                       "allowServiceAccount": False}
    every = _policy_messages(docs)
    for setting in ("allowHostNamespaces", "allowHostPath", "allowPrivileged", "allowServiceAccount"):
        assert f"podPolicy.{setting}" in every
    binding = ht.find(docs, "ValidatingAdmissionPolicyBinding", "kubetrain-admission")
    assert binding["spec"]["validationActions"] == ["Deny"] and "matchResources" not in binding["spec"]
    allowed = ht.render(set_values={"podPolicy.allowHostPath": True, "podPolicy.allowServiceAccount": True})
    some = _policy_messages(allowed)
    assert "podPolicy.allowHostPath" not in some and "podPolicy.allowServiceAccount" not in some
    assert "podPolicy.allowPrivileged" in some and "nodeName" in some  # what kubetrain owns stays refused
    queued = ht.render(set_values={"queues.requiredIn": ["team-a", "team-b"]})
    assert "chart value queues.requiredIn" in _policy_messages(queued) and "queues.requiredIn" not in every
    env = {e["name"]: e.get("value") for e in ht.find(queued, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBETRAIN_QUEUE_REQUIRED_IN"] == "team-a,team-b"
    off = ht.render(set_values={"podPolicy.admission": False})
    assert not [d for d in off if d["kind"].startswith("ValidatingAdmissionPolicy")]
    namespaced = ht.render(set_values={"rbac.scope": "namespaced", "rbac.watchNamespace": "team-a"})
    for name in ("kubetrain-admission", "kubetrain-worker-pods"):
        binding = ht.find(namespaced, "ValidatingAdmissionPolicyBinding", name)
        assert binding["spec"]["matchResources"]["namespaceSelector"] == {
            "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a"]}]}


def test_the_admission_policy_allows_each_fabric_the_capabilities_its_profile_adds(helm_ok: None) -> None:
    """The chart's CEL copy of what the operator allows a podTemplate to add (kubetrain.core.pod_template and
    the fabric profiles): the API server and the operator judge a capability alike."""
    policy = ht.find(ht.render(set_values={"podPolicy.allowedCapabilities": ["SYS_PTRACE"]}),
                     "ValidatingAdmissionPolicy", "kubetrain-admission")
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert json.loads(variables["fabricCapabilities"]) == {n: sorted(p.all_capabilities()) for n, p in FABRICS.items()}
    baseline, allowed, _ = variables["allowedCapabilities"].split(" + ", 2)
    assert (set(json.loads(baseline)), json.loads(allowed)) == (BASELINE_CAPABILITIES, ["SYS_PTRACE"])
    worker = ht.find(ht.render(), "ValidatingAdmissionPolicy", "kubetrain-worker-pods")
    assert worker["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["UPDATE"]
