"""Runtimes: a job's spec over its TrainingRuntime or ClusterTrainingRuntime, in validate, local runs and plan()."""

import json
from datetime import UTC, datetime

import pytest
import yaml
from support.paths import RUNTIME_CRD_FILES

from kubetrain.core import api, runtimes, validate
from kubetrain.core.cli import main
from kubetrain.core.crd import cluster_runtime_crd, crd, runtime_crd
from kubetrain.core.pod_template import PodPolicy
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs import runtimes as op
from kubetrain.operator.jobs.plan import Observation, plan
from kubetrain.trainer.config import load_spec

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
S = b.WorkerSettings(trainer_image="trainer:test")
EFA = {"image": "reg.example/trainer:1", "fabric": "efa", "fabricOptions": {"instanceType": "p4d.24xlarge"},
       "env": [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "TEAM", "value": "none"}],
       "resources": {"gpusPerWorker": 8},
       "scheduling": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
       "podTemplate": {"spec": {"containers": [{"name": "trainer", "volumeMounts": [{"name": "a", "mountPath": "/a"}]}],
                                "volumes": [{"name": "a", "emptyDir": {}}]}},
       "checkpoint": {"storageClassName": "efs-sc", "accessMode": "ReadWriteMany"},
       "locked": ["image", "fabric", "fabricOptions"]}
TCPX = {"fabric": "tcpx", "fabricOptions": {"daemonImage": "reg.example/rxdm:v9"}, "locked": ["fabricOptions"]}


def job_spec(**spec):
    return api.TrainingJobSpec.model_validate({"runtimeRef": {"name": "gpu"}, **spec})


def resolved(runtime, kind="ClusterTrainingRuntime", **spec):
    return runtimes.resolve(job_spec(**spec), kind, "gpu", api.TrainingRuntimeSpec.model_validate(runtime))


def test_what_a_job_leaves_unset_comes_from_its_runtime_and_what_it_sets_wins():
    r = resolved(EFA, workers=4, env=[{"name": "TEAM", "value": "nlp"}], scheduling={"nodeSelector": {"zone": "a"},
                 "tolerations": [{"key": "spot", "operator": "Exists"}]}, resources={"gpusPerWorker": 4},
                 podTemplate={"spec": {"containers": [{"name": "trainer", "volumeMounts": [{"name": "b", "mountPath": "/b"}]}],
                                       "volumes": [{"name": "b", "emptyDir": {}}]}})
    assert r.problems == [] and r.spec is not None
    s = r.spec
    assert (s.image, s.fabric, s.fabric_options.instance_type, s.workers) == ("reg.example/trainer:1", "efa",
                                                                             "p4d.24xlarge", 4)
    assert s.env == [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "TEAM", "value": "nlp"}]  # by name
    assert s.scheduling.node_selector == {"pool": "gpu", "zone": "a"}
    assert [t["key"] for t in s.scheduling.tolerations] == ["nvidia.com/gpu", "spot"]  # they add up
    assert s.resources.gpus_per_worker == 4  # not locked: the job's
    mounts = s.pod_template["spec"]["containers"][0]["volumeMounts"]
    assert [m["name"] for m in mounts] == ["a", "b"] and [v["name"] for v in s.pod_template["spec"]["volumes"]] == ["a", "b"]
    assert (s.checkpoint.storage_class_name, s.checkpoint.access_mode) == ("efs-sc", "ReadWriteMany")
    assert s.runtime_ref == api.RuntimeRef(name="gpu")


@pytest.mark.parametrize(("spec", "path"), [
    ({"image": "mine/trainer:2"}, "spec.image"),
    ({"fabric": "infiniband"}, "spec.fabric"),
    ({"fabricOptions": {"socketIfname": "eth1"}}, "spec.fabricOptions"),
])
def test_a_job_that_sets_a_locked_field_otherwise_is_refused_naming_it(spec, path):
    r = resolved(EFA, **spec)
    assert r.spec is None and [p.split(":")[0] for p in r.problems] == [path]
    assert "locked by ClusterTrainingRuntime gpu" in r.problems[0]


def test_a_locked_field_restated_as_the_runtime_has_it_is_no_override():
    assert resolved(EFA, image="reg.example/trainer:1", fabric="efa").problems == []


def test_a_locked_field_the_runtime_leaves_unset_stays_unset():
    runtime = {"image": "reg.example/trainer:1", "locked": ["scheduling.priorityClassName"]}
    assert resolved(runtime, scheduling={"priorityClassName": "high"}).problems == [
        "spec.scheduling.priorityClassName: locked by ClusterTrainingRuntime gpu (which leaves it unset)"]
    assert resolved(runtime, scheduling={"queue": "team-a"}).problems == []


def test_a_job_never_names_its_fabric_daemon_image_but_a_runtime_does(tmp_path):
    doc = {"apiVersion": api.API_VERSION, "kind": "TrainingJob", "metadata": {"name": "j"},
           "spec": {"fabric": "tcpx", "fabricOptions": {"daemonImage": "evil.example/rxdm:1"}}}
    assert [p.path for p in validate.check(doc)[1]] == ["spec.fabricOptions.daemonImage"]
    r = resolved(TCPX)
    assert r.problems == [] and r.spec.fabric_options.daemon_image == "reg.example/rxdm:v9" and r.fabric_from_runtime
    job = api.TrainingJob(metadata=api.ObjectMeta(name="j", namespace="ns"), spec=r.spec)
    pod = b.worker_pod(job, 0, 0, S)
    assert [c["image"] for c in pod["spec"]["initContainers"] if c["name"] == "tcpx-daemon"] == ["reg.example/rxdm:v9"]
    config = json.loads(b.config_map(job)["data"]["config.json"])
    assert "runtimeRef" not in config and config["fabricOptions"]["daemonImage"] == "reg.example/rxdm:v9"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert load_spec(path).fabric_options.daemon_image == "reg.example/rxdm:v9"  # the trainer takes it


def test_rules_that_join_a_job_to_its_runtime_hold_for_the_merge_not_for_the_job_alone():
    doc = {"apiVersion": api.API_VERSION, "kind": "TrainingJob", "metadata": {"name": "j"},
           "spec": {"runtimeRef": {"name": "gpu"}, "fabricOptions": {"socketIfname": "eth1"},
                    "strategy": "fsdp", "parallelism": {"tensor": 2}}}
    assert validate.check(doc)[1] == []  # the runtime's fabric and GPUs make them whole
    without = {**doc, "spec": {k: v for k, v in doc["spec"].items() if k != "runtimeRef"}}
    assert {p.path for p in validate.check(without)[1]} == {"spec.fabricOptions", "spec.parallelism.tensor"}
    assert resolved({"fabric": "efa", "resources": {"gpusPerWorker": 8}}, **doc["spec"]).problems == []
    bad = resolved({"fabric": "efa", "resources": {"gpusPerWorker": 1}}, **doc["spec"]).problems
    assert [p.split(":")[0] for p in bad] == ["spec.parallelism.tensor"] and "(with ClusterTrainingRuntime gpu)" in bad[0]


def test_a_runtime_is_checked_on_its_own():
    doc = {"apiVersion": api.API_VERSION, "kind": "ClusterTrainingRuntime", "metadata": {"name": "gpu.h100"},
           "spec": {"locked": ["image", "workers"], "podTemplate": {"spec": {"nodeName": "n1"}}}}
    problems = [str(p) for p in validate.check_runtime(doc)[1]]
    assert problems[0].startswith("spec.locked[1]: 'workers' is no field of a runtime")
    assert problems[1].startswith("spec.podTemplate.spec.nodeName:")


def test_the_runtime_crds_store_what_the_admin_wrote_and_lock_only_their_fields():
    for definition, scope in ((runtime_crd(), "Namespaced"), (cluster_runtime_crd(), "Cluster")):
        assert definition["spec"]["scope"] == scope
        assert "default:" not in yaml.safe_dump(definition)  # a default would override every job's value
        spec = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        assert spec["properties"]["locked"]["items"]["enum"] == runtimes.lockable_paths()
        assert "subresources" not in definition["spec"]["versions"][0]
    job_spec_schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = {r["rule"] for r in job_spec_schema["x-kubernetes-validations"]}
    assert api.DAEMON_IMAGE_RULE.cel in rules
    assert "has(self.runtimeRef) || (!has(self.fabricOptions) || self.fabric != 'none')" in rules


@pytest.mark.parametrize("kind", ["TrainingRuntime", "ClusterTrainingRuntime"])
def test_the_runtime_crds_in_crds_dir_match_the_models(kind, capsys):
    assert main(["crd", "--kind", kind]) == 0
    committed = {p.name: p.read_text() for p in RUNTIME_CRD_FILES}[f"kubetrain.io_{kind.lower()}s.yaml"]
    assert capsys.readouterr().out == committed, "crds/ drifted from kubetrain.core.api: run `make crds`"


def test_a_file_with_the_runtime_is_judged_over_it_and_a_local_run_needs_it(tmp_path):
    runtime = {"apiVersion": api.API_VERSION, "kind": "ClusterTrainingRuntime", "metadata": {"name": "gpu"},
               "spec": EFA}
    job = {"apiVersion": api.API_VERSION, "kind": "TrainingJob", "metadata": {"name": "j"},
           "spec": {"runtimeRef": {"name": "gpu"}, "image": "mine/t:1"}}
    verdicts = validate.judge([runtime, job])
    assert [str(p) for v in verdicts for p in v.problems] == [
        'spec.image: locked by ClusterTrainingRuntime gpu to "reg.example/trainer:1"']
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    with pytest.raises(validate.ManifestError, match="is not in this file"):
        validate.load_job(path)
    del job["spec"]["image"]
    path.write_text(yaml.safe_dump_all([runtime, job]))
    assert validate.load_job(path).spec.image == "reg.example/trainer:1"


# --------------------------------------------------------------------------- the operator


def body(status=None, **spec):
    return {"apiVersion": api.API_VERSION, "kind": "TrainingJob",
            "metadata": {"name": "j", "namespace": "ns", "uid": "uid-1", "generation": 1},
            "spec": {"runtimeRef": {"name": "gpu"}, **spec}, "status": status or {}}


def stored(spec, kind="ClusterTrainingRuntime", version="7"):
    return op.RuntimeLookup(body={"apiVersion": api.API_VERSION, "kind": kind,
                                  "metadata": {"name": "gpu", "resourceVersion": version}, "spec": spec})


def conditions(p):
    return {c["type"]: (c["status"], c["reason"]) for c in p.status["conditions"]}


def test_the_operator_runs_a_job_over_its_runtime_and_records_it():
    p = plan(Observation(body(), [], {}, T0, runtime=stored(EFA)), S)
    pods = [o for o in p.create if o["kind"] == "Pod"]
    assert pods and all(o["spec"]["containers"][0]["image"] == "reg.example/trainer:1" for o in pods)
    assert pods[0]["spec"]["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == "4"  # p4d
    assert p.status["runtime"] == {"kind": "ClusterTrainingRuntime", "name": "gpu", "resourceVersion": "7",
                                   "spec": EFA}
    assert conditions(p)["RuntimeResolved"] == ("True", "RuntimeApplied")


def test_a_job_whose_runtime_is_missing_waits_pending_and_says_so():
    lookup = op.RuntimeLookup(missing="not found")
    p = plan(Observation(body(), [], {}, T0, runtime=lookup), S)
    assert p.create == [] and p.status["phase"] == "Pending" and p.requeue_after == op.RUNTIME_LOOK_AGAIN_SECONDS
    assert conditions(p)["RuntimeResolved"] == ("False", "RuntimeNotFound")
    assert "ClusterTrainingRuntime gpu (cluster-wide): not found" in p.status["message"]
    assert [e[1] for e in p.events] == ["RuntimeNotFound"]


def test_a_job_overriding_a_locked_field_fails_naming_it():
    p = plan(Observation(body(image="mine/t:2"), [], {}, T0, runtime=stored(EFA)), S)
    assert p.create == [] and p.status["phase"] == "Failed" and p.status["reason"] == "InvalidSpec"
    assert 'spec.image: locked by ClusterTrainingRuntime gpu to "reg.example/trainer:1"' in p.status["message"]


def test_a_started_job_keeps_the_runtime_it_started_with():
    first = plan(Observation(body(), [], {}, T0, runtime=stored(EFA)), S)
    later = body(status={**first.status, "phase": "Running"})
    assert op.to_read(later) is None and op.to_read(body()) == api.RuntimeRef(name="gpu")
    again = plan(Observation(later, [], {}, T0, runtime=None), S)  # restarted pods: the recorded runtime's image
    assert all(o["spec"]["containers"][0]["image"] == "reg.example/trainer:1" for o in again.create
               if o["kind"] == "Pod")


@pytest.mark.parametrize(("own", "uri"), [(None, "s3://team/ckpt/ns/j-uid-1"), ("s3://mine/run", "s3://mine/run")])
def test_a_runtime_s_checkpoint_uri_is_a_prefix_with_one_of_its_own_for_each_job(own, uri):
    spec = {"checkpoint": {"uri": own}} if own else {}
    p = plan(Observation(body(**spec), [], {}, T0, runtime=stored({"checkpoint": {"uri": "s3://team/ckpt/"}})), S)
    pod = next(o for o in p.create if o["kind"] == "Pod")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["KUBETRAIN_CHECKPOINT_URI"] == uri


@pytest.mark.parametrize(("source", "allow_host_path", "refused"), [
    ("job", False, True), ("job", True, False), ("ClusterTrainingRuntime", False, False),
    ("TrainingRuntime", False, True),
])
def test_a_fabric_that_mounts_the_node_comes_from_a_cluster_runtime_or_the_pod_policy(source, allow_host_path, refused):
    settings = b.WorkerSettings(trainer_image="trainer:test", pod_policy=PodPolicy(allow_host_path=allow_host_path))
    if source == "job":
        seen = Observation(body(fabric="tcpx"), [], {}, T0, runtime=stored({"image": "reg.example/t:1"}))
    else:
        seen = Observation(body(runtimeRef={"kind": source, "name": "gpu"}), [], {}, T0,
                           runtime=stored(TCPX, kind=source))
    p = plan(seen, settings)
    assert (p.status["phase"] == "Failed") is refused
    if refused:
        assert "spec.fabric: tcpx mounts /home/kubernetes/bin/nvidia/lib64, /sys, /proc/sys of the node" in p.status["message"]


# --------------------------------------------------------------------------- what a podTemplate or an edit could get around


def test_a_job_s_pod_template_cannot_set_what_its_runtime_locks():
    template = {"spec": {"containers": [{"name": "trainer", "image": "evil.example/t:1", "env": [{"name": "A"}]}],
                         "nodeSelector": {"pool": "cpu"}}}
    r = resolved({**EFA, "locked": ["image", "scheduling"]}, podTemplate=template)
    assert r.spec is None and sorted(p.split(":")[0] for p in r.problems) == [
        "spec.podTemplate.spec.containers[trainer].image", "spec.podTemplate.spec.nodeSelector"]
    assert resolved({**EFA, "locked": ["scheduling.tolerations"]}, podTemplate=template).problems == []


def test_a_job_s_pod_template_cannot_take_its_fabric_s_daemon_or_node_directories():
    template = {"spec": {"initContainers": [{"name": "tcpx-daemon", "image": "evil.example/d:1"}],
                         "containers": [{"name": "trainer", "volumeMounts": [{"name": "sys", "mountPath": "/s"}]}]}}
    p = plan(Observation(body(podTemplate=template), [], {}, T0, runtime=stored(TCPX)), S)
    assert p.status["phase"] == "Failed" and p.create == []
    message = p.status["message"]
    assert "spec.podTemplate.spec.initContainers[tcpx-daemon]: the tcpx fabric's own sidecar" in message
    assert "spec.podTemplate.spec.containers[trainer].volumeMounts[sys]: a directory of the node" in message


def test_a_job_s_own_daemon_image_stored_before_the_rule_fails_only_a_job_not_started():
    spec = {"fabric": "tcpx", "fabricOptions": {"daemonImage": "old.example/d:1"}}
    fresh = dict(body(), spec=spec)
    p = plan(Observation(fresh, [], {}, T0), b.WorkerSettings(trainer_image="t:1", pod_policy=PodPolicy(allow_host_path=True)))
    assert p.status["phase"] == "Failed" and "spec.fabricOptions.daemonImage" in p.status["message"]
    running = dict(body(status={"phase": "Running", "startTime": "2026-03-01T11:00:00Z"}), spec=spec)
    p = plan(Observation(running, [], {}, T0), S)
    assert p.status is None or p.status["phase"] != "Failed"


def test_a_started_job_s_edit_of_a_locked_field_is_not_applied_and_said():
    runtime = {**EFA, "locked": ["scheduling.nodeSelector"]}
    first = plan(Observation(body(), [], {}, T0, runtime=stored(runtime)), S)
    edited = body(status={**first.status, "phase": "Running"}, scheduling={"nodeSelector": {"pool": "cpu"}})
    again = plan(Observation(edited, [], {}, T0), S)
    assert again.status["phase"] != "Failed"
    assert all(o["spec"]["nodeSelector"]["pool"] == "gpu" for o in again.create if o["kind"] == "Pod")
    resolved_condition = next(c for c in again.status["conditions"] if c["type"] == "RuntimeResolved")
    assert "edits not applied: spec.scheduling.nodeSelector: locked by" in resolved_condition["message"]


def test_a_job_suspended_from_the_start_reads_its_runtime_until_it_first_runs():
    suspended = body(status={"phase": "Suspended", "runtime": {"kind": "ClusterTrainingRuntime", "name": "gpu"}})
    assert op.to_read(suspended) == api.RuntimeRef(name="gpu")
    ran = body(status={"phase": "Suspended", "startTime": "2026-03-01T11:00:00Z",
                       "runtime": {"kind": "ClusterTrainingRuntime", "name": "gpu"}})
    assert op.to_read(ran) is None


def test_env_of_the_same_name_replaces_whole_and_a_checkpoint_lock_covers_storage_only():
    runtime = {"podTemplate": {"spec": {"containers": [{"name": "trainer", "env": [
        {"name": "TOK", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}]}},
        "checkpoint": {"storageClassName": "efs-sc"}, "locked": ["checkpoint"]}
    r = resolved(runtime, podTemplate={"spec": {"containers": [{"name": "trainer", "env": [{"name": "TOK", "value": "x"}]}]}},
                 checkpoint={"everySteps": 7})
    assert r.problems == [] and r.spec.checkpoint.every_steps == 7
    assert r.spec.pod_template["spec"]["containers"][0]["env"] == [{"name": "TOK", "value": "x"}]
    assert resolved(runtime, checkpoint={"storageClassName": "gp3"}).problems[0].startswith("spec.checkpoint: locked")


def test_a_runtime_gives_no_queue_and_a_file_with_another_runtime_leaves_the_job_to_the_cluster():
    queued = {"apiVersion": api.API_VERSION, "kind": "ClusterTrainingRuntime", "metadata": {"name": "gpu"},
              "spec": {"scheduling": {"queue": "team-a"}}}
    assert [p.path for p in validate.check_runtime(queued)[1]] == ["spec.scheduling.queue"]
    other = {**queued, "metadata": {"name": "other"}, "spec": {}}
    job = {"apiVersion": api.API_VERSION, "kind": "TrainingJob", "metadata": {"name": "j"},
           "spec": {"runtimeRef": {"name": "gpu"}}}
    assert [v.problems for v in validate.judge([other, job])] == [[], []]
