"""Checkpoint storage a gang can share: on a StorageClass that offers ReadWriteOnce only, a job with several
workers keeps its checkpoints in the operator's object store (or waits, saying why), decided once."""

import json
from datetime import UTC, datetime, timedelta

import pytest

from kubetrain.core import api
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs import storage
from kubetrain.operator.jobs.plan import Observation, plan
from kubetrain.operator.runtime.settings import ENV_CHECKPOINT_STORE, parse_settings

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
STORE = api.CheckpointStore(uri="s3://ckpts/jobs", s3=api.S3Spec(endpoint="http://store:8333",
                                                                   credentials_secret="s3-keys"))
S = b.WorkerSettings(trainer_image="trainer:test", checkpoint_store=STORE)


def sc(name, provisioner, default=False, modes=None):
    annotations = {"storageclass.kubernetes.io/is-default-class": "true"} if default else {}
    if modes is not None:
        annotations[api.ACCESS_MODES_ANNOTATION] = modes
    return {"metadata": {"name": name, "annotations": annotations}, "provisioner": provisioner}


GP3 = sc("gp3", "ebs.csi.aws.com", default=True)
EFS = sc("efs-sc", "efs.csi.aws.com")
CLASSES = [GP3, EFS, sc("local-rwo", "rancher.io/local-path", modes="ReadWriteOnce"),
           sc("nfs", "ebs.csi.aws.com", modes="ReadWriteOnce, ReadWriteMany")]


def body(status=None, workers=2, **spec):
    return {"apiVersion": api.API_VERSION, "kind": "TrainingJob",
            "metadata": {"name": "j", "namespace": "ns", "uid": "uid-1", "generation": 1},
            "spec": {"workers": workers, **spec}, "status": status or {}}


@pytest.mark.parametrize(("wanted", "shared"), [
    (None, False), ("gp3", False), ("efs-sc", None), ("local-rwo", False), ("nfs", True), ("missing", None)])
def test_what_a_class_offers_comes_from_its_annotation_else_its_provisioner(wanted, shared):
    assert storage.facts_of(CLASSES, wanted).read_write_many is shared


def test_two_default_classes_or_none_leave_the_default_unknown():
    assert storage.facts_of([GP3, sc("other", "ebs.csi.aws.com", default=True)], None).name is None
    assert storage.facts_of([EFS], None).read_write_many is None


def claims(p):
    return [o for o in p.create if o["kind"] == "PersistentVolumeClaim"]


def trainer_env(p):
    pod = next(o for o in p.create if o["kind"] == "Pod")
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}


def test_two_workers_on_a_read_write_once_class_keep_their_checkpoints_in_the_operators_store():
    p = plan(Observation(body(), [], {}, T0, storage_classes=CLASSES), S)
    uri = "s3://ckpts/jobs/ns/j-uid-1"
    assert claims(p) == [] and p.status["checkpointStore"] == {"uri": uri, "s3": {
        "endpoint": "http://store:8333", "credentialsSecret": "s3-keys"}}
    assert trainer_env(p)["KUBETRAIN_CHECKPOINT_URI"] == uri
    durable = next(c for c in p.status["conditions"] if c["type"] == "CheckpointsDurable")
    assert (durable["status"], durable["reason"]) == ("True", "OperatorStore") and uri in durable["message"]
    # decided once: a started job keeps it without reading the classes again, whatever they say now
    later = body(status={**p.status, "phase": "Running"})
    assert not storage.to_read(later)
    again = plan(Observation(later, [], {}, T0, storage_classes=None), S)  # its pods are gone: a restart
    assert again.status["checkpointStore"]["uri"] == uri
    again = plan(Observation(body(status=again.status), [], {}, T0 + timedelta(minutes=10), storage_classes=None), S)
    assert claims(again) == [] and trainer_env(again)["KUBETRAIN_CHECKPOINT_URI"] == uri


@pytest.mark.parametrize("spec", [
    {"workers": 1}, {"checkpoint": {"storageClassName": "efs-sc"}}, {"checkpoint": {"accessMode": "ReadWriteOnce"}},
    {"checkpoint": {"claimName": "mine"}}, {"checkpoint": {"uri": "s3://own/run"}}])
def test_a_job_whose_claim_needs_no_sharing_or_that_chose_its_storage_is_left_as_it_is(spec):
    p = plan(Observation(body(**spec), [], {}, T0, storage_classes=CLASSES), S)
    assert "checkpointStore" not in p.status and p.create
    assert trainer_env(p).get("KUBETRAIN_CHECKPOINT_URI") == (spec.get("checkpoint") or {}).get("uri")


def test_a_job_that_started_on_a_claim_keeps_it():
    started = {"phase": "Running", "startTime": "2026-03-01T11:00:00Z"}
    p = plan(Observation(body(status=started), [], {}, T0, storage_classes=CLASSES), S)
    assert "checkpointStore" not in (p.status or {}) and "KUBETRAIN_CHECKPOINT_URI" not in trainer_env(p)


@pytest.mark.parametrize(("settings", "spec", "says"), [
    (b.WorkerSettings(trainer_image="t"), {}, "the operator has no checkpoint store (chart value checkpointStore)"),
    (S, {"s3": {"endpoint": "http://mine:9000"}, "data": {"uri": "s3://mine/tokens"}}, "the job's own spec.s3 would serve the operator's checkpoint store"),
])
def test_without_a_store_it_can_use_the_job_waits_pending_naming_the_ways_out(settings, spec, says):
    p = plan(Observation(body(**spec), [], {}, T0, storage_classes=CLASSES), settings)
    assert p.create == [] and p.status["phase"] == "Pending" and p.requeue_after == storage.LOOK_AGAIN_SECONDS
    assert p.status["reason"] == "NoSharedStorage" and says in p.status["message"]
    assert "StorageClass gp3 (ebs.csi.aws.com) offers ReadWriteOnce only" in p.status["message"]
    assert "spec.checkpoint.uri" in p.status["message"] and [e[1] for e in p.events] == ["NoSharedStorage"]


def test_the_chart_value_becomes_the_operators_store_and_a_bad_one_stops_its_start(capsys):
    raw = json.dumps({"uri": "s3://ckpts/jobs", "s3": {"endpoint": "http://store:8333"}})
    assert parse_settings([], {ENV_CHECKPOINT_STORE: raw}).builders.checkpoint_store == api.CheckpointStore(
        uri="s3://ckpts/jobs", s3=api.S3Spec(endpoint="http://store:8333"))
    assert parse_settings([], {ENV_CHECKPOINT_STORE: json.dumps({"uri": "", "s3": {}})}).builders.checkpoint_store \
        is None
    with pytest.raises(SystemExit):
        parse_settings([], {ENV_CHECKPOINT_STORE: json.dumps({"uri": "gs://x/y"})})
    assert "KUBETRAIN_CHECKPOINT_STORE (chart value checkpointStore): uri:" in capsys.readouterr().err
