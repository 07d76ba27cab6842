"""What a job's podTemplate may hold: its shape, the fields kubetrain owns, and the host-level fields the
operator's PodPolicy decides; the operator fails a job that asks for more, naming the field."""

from datetime import UTC, datetime

import pytest

from kubetrain.core.api import TrainingJob
from kubetrain.core.pod_template import PodPolicy, host_problems, owned_problems, shape_problems
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs.plan import Observation, plan
from kubetrain.operator.runtime.settings import parse_settings, pod_policy

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
OFF = PodPolicy()

SHAPES = [
    ([], [("podTemplate", "must be a mapping: a partial PodTemplateSpec (metadata, spec)")]),
    ({"spec": 5}, [("podTemplate.spec", "must be a mapping")]),
    ({"spec": [{"containers": []}]}, [("podTemplate.spec", "must be a mapping")]),
    ({"kind": "Pod"}, [("podTemplate.kind", "unknown field: a PodTemplateSpec has metadata and spec")]),
    ({"metadata": {"labels": {"team": 7}}}, [("podTemplate.metadata.labels", "must map names to strings")]),
    ({"spec": {"containers": {"name": "trainer"}}}, [("podTemplate.spec.containers", "must be a list of mappings")]),
    ({"spec": {"volumes": ["scratch"]}}, [("podTemplate.spec.volumes", "must be a list of mappings")]),
    ({"spec": {"securityContext": "root"}}, [("podTemplate.spec.securityContext", "must be a mapping")]),
    ({"spec": {"containers": [{"name": "trainer", "env": {"A": "1"}}]}},
     [("podTemplate.spec.containers[0].env", "must be a list of mappings")]),
    ({"metadata": {"labels": {"team": "a"}}, "spec": {"containers": [{"name": "trainer", "env": [{"name": "A"}]}]}}, []),
]


@pytest.mark.parametrize(("template", "problems"), SHAPES)
def test_a_value_of_the_wrong_kind_is_named(template, problems):
    assert shape_problems(template) == problems


OWNED = [
    ({"spec": {"nodeName": "gpu-7"}},
     "podTemplate.spec.nodeName", "would bypass the scheduler and any queue: use scheduling.nodeSelector or "
                                  "podTemplate.spec.affinity"),
    ({"metadata": {"ownerReferences": []}}, "podTemplate.metadata.ownerReferences", "is set by kubetrain for each worker pod"),
    ({"metadata": {"namespace": "other"}}, "podTemplate.metadata.namespace", "is set by kubetrain for each worker pod"),
    ({"metadata": {"annotations": {"kubetrain.io/progress": "{\"step\": 99999}"}}},
     "podTemplate.metadata.annotations[kubetrain.io/progress]", "kubetrain.io/ annotations are kubetrain's own"),
    ({"metadata": {"labels": {"kubetrain.io/job-name": "other"}}},
     "podTemplate.metadata.labels[kubetrain.io/job-name]", "kubetrain.io/ labels are kubetrain's own"),
]


@pytest.mark.parametrize(("template", "path", "reason"), OWNED, ids=[o[1] for o in OWNED])
def test_fields_kubetrain_owns_are_refused_everywhere(template, path, reason):
    assert owned_problems(template) == [(path, reason)]
    assert owned_problems({"metadata": {"labels": {"team": "a"}, "annotations": {"kueue.x-k8s.io/x": "y"}}}) == []


HOSTILE = {"spec": {
    "hostNetwork": True, "hostPID": True, "hostIPC": False, "serviceAccountName": "cluster-admin-sa",
    "volumes": [{"name": "root", "hostPath": {"path": "/"}}, {"name": "scratch", "emptyDir": {}}],
    "containers": [{"name": "trainer", "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN", "CHOWN"]}},
                    "ports": [{"containerPort": 22, "hostPort": 22}]}],
    "initContainers": [{"name": "setup", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}],
}}


def test_host_level_fields_are_refused_by_default_each_naming_its_setting():
    found = dict(host_problems(HOSTILE, OFF, frozenset()))
    assert sorted(found) == [
        "podTemplate.spec.containers[0].ports[0].hostPort",
        "podTemplate.spec.containers[0].securityContext.capabilities.add",
        "podTemplate.spec.containers[0].securityContext.privileged",
        "podTemplate.spec.hostNetwork", "podTemplate.spec.hostPID",
        "podTemplate.spec.initContainers[0].securityContext.capabilities.add",
        "podTemplate.spec.serviceAccountName", "podTemplate.spec.volumes[0].hostPath",
    ]
    assert found["podTemplate.spec.volumes[0].hostPath"] == (
        "mounts a directory of the node: not allowed by this cluster's operator (chart value podPolicy.allowHostPath)")
    assert found["podTemplate.spec.containers[0].securityContext.capabilities.add"].startswith(
        "adds SYS_ADMIN, beyond Pod Security baseline")  # CHOWN is baseline's


def test_the_policy_allows_what_the_admin_chose_and_the_fabric_needs():
    policy = PodPolicy(allow_privileged=True, allow_host_path=True, allow_host_namespaces=True,
                       allowed_capabilities=frozenset({"SYS_ADMIN"}), allow_service_account=True)
    assert host_problems(HOSTILE, policy, frozenset()) == [
        ("podTemplate.spec.initContainers[0].securityContext.capabilities.add",
         "adds IPC_LOCK, beyond Pod Security baseline and the fabric's: not allowed by this cluster's operator "
         "(chart value podPolicy.allowedCapabilities)")]
    assert host_problems(HOSTILE, policy, frozenset({"IPC_LOCK"})) == []  # e.g. fabric infiniband


def test_the_chart_value_reaches_the_operator_as_a_policy():
    raw = '{"allowPrivileged": true, "allowHostPath": false, "allowHostNamespaces": false, ' \
          '"allowedCapabilities": ["cap_sys_ptrace"], "allowServiceAccount": false}'
    assert pod_policy(raw) == PodPolicy(allow_privileged=True, allowed_capabilities=frozenset({"SYS_PTRACE"}))
    assert parse_settings([], {}).builders.pod_policy == OFF
    with pytest.raises(ValueError, match="'allowRoot' is not a boolean podPolicy setting"):
        pod_policy('{"allowRoot": true}')


def body(template, status=None):
    job = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "j", "namespace": "ns", "uid": "u-1", "resourceVersion": "3"},
           "spec": {"workers": 2, "podTemplate": template}}
    return job | ({"status": status} if status else {})


def test_the_operator_fails_a_new_job_that_asks_for_the_host_and_creates_no_pod():
    p = plan(Observation(body({"spec": {"hostNetwork": True}}), [], {}, NOW), b.WorkerSettings())
    assert p.create == [] and p.status is not None
    assert (p.status["phase"], p.status["reason"]) == ("Failed", "InvalidSpec")
    assert p.status["message"] == (
        "invalid spec: spec.podTemplate.spec.hostNetwork: shares the node's namespace: not allowed by this "
        "cluster's operator (chart value podPolicy.allowHostNamespaces)")
    allowed = b.WorkerSettings(pod_policy=PodPolicy(allow_host_namespaces=True))
    assert len(plan(Observation(body({"spec": {"hostNetwork": True}}), [], {}, NOW), allowed).create) > 2


def test_a_job_that_already_ran_is_not_failed_by_a_tightened_policy():
    running = {"phase": "Running", "restartGeneration": 0}
    p = plan(Observation(body({"spec": {"hostNetwork": True}}, running), [], {}, NOW), b.WorkerSettings())
    assert p.status is None or p.status.get("phase") != "Failed"


def test_an_owned_field_fails_the_job_whatever_the_policy():
    problems = TrainingJob.model_validate(body({"spec": {"nodeName": "n1"}})).spec.rule_violations()
    assert [p for p, _ in problems] == ["podTemplate.spec.nodeName"]
    p = plan(Observation(body({"spec": {"nodeName": "n1"}}), [], {}, NOW),
             b.WorkerSettings(pod_policy=PodPolicy(allow_host_namespaces=True)))
    assert p.status is not None and p.status["reason"] == "InvalidSpec" and "spec.podTemplate.spec.nodeName" in (
        p.status["message"])


def test_a_template_nested_beyond_any_pod_is_refused_before_the_builder_recurses_over_it():
    deep: dict = {}
    node = deep
    for _ in range(5000):  # the API server stores deeper objects than Python's recursion limit allows
        node["x"] = {}
        node = node["x"]
    assert shape_problems({"spec": {"containers": [{"name": "trainer", "env": [deep]}]}}) == [
        ("podTemplate", "nested more than 100 levels deep")]
    p = plan(Observation(body({"spec": {"affinity": deep}}), [], {}, NOW), b.WorkerSettings())
    assert p.create == [] and p.status["message"] == "invalid spec: spec.podTemplate: nested more than 100 levels deep"


def test_a_namespace_may_require_a_queue_of_its_new_jobs():
    settings = b.WorkerSettings(queue_required_in=frozenset({"ns"}))
    p = plan(Observation(body({}), [], {}, NOW), settings)
    assert p.create == [] and p.status["message"] == (
        "invalid spec: spec.scheduling.queue: required in namespace ns (chart value queues.requiredIn)")
    queued = body({}) | {"spec": {"workers": 2, "scheduling": {"queue": "team"}}}
    assert plan(Observation(queued, [], {}, NOW), settings).status["phase"] != "Failed"
    assert parse_settings([], {"KUBETRAIN_QUEUE_REQUIRED_IN": "a, b,"}).builders.queue_required_in == {"a", "b"}
