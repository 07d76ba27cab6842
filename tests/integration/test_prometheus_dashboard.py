"""Acceptance 3: a real Prometheus scrapes the operator and the trainer workers of a local run,
and every panel query of the shipped Grafana dashboard returns data.

One scenario feeds every metric: the operator (a process, watching the test namespace) takes a
TrainingJob to Running on kwok GPU nodes, restarts the gang after a worker fails and then sees it
succeed, then runs a one-trial TrainingSweep to its best value; meanwhile `kubetrain run` trains a
tiny model as 2 local workers, with one injected failure (a restart from checkpoint). Prometheus
(Debian's package, hack/prometheus.sh) scrapes both every second and also loads the chart's alert
rules.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from support import helm_tool as ht
from support import prom_server as ps
from support.cluster import kubeconfig_path
from support.jobs import TrainingJobs
from support.kwok import fail_pod, kwok_job, succeed_workers
from support.operator_process import OperatorProcess
from support.paths import CHART, EXAMPLE_DATA
from support.ports import free_port
from support.processes import stop_process
from support.resources import apply, apply_crds
from support.sweeps import TrainingSweeps, finish_trial, kwok_sweep
from support.waiting import wait_for

from kubetrain.core import api, contract
from kubetrain.core.progress import Progress

pytestmark = pytest.mark.integration
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
RATE_INTERVAL = "1m"


GPU_ROW = "GPUs"
"""Panels under this row need GPU workers (and NVIDIA's DCGM exporter): with none here, their queries must
evaluate, but no data is expected."""


def panel_queries(gpu: bool = False) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, with Grafana's variables filled in; `gpu`: the
    panels under GPU_ROW instead of the others."""
    out = []
    for path in DASHBOARDS:
        row = ""
        for p in json.loads(path.read_text())["panels"]:
            row = p["title"] if p["type"] == "row" else row
            if (row == GPU_ROW) != gpu:
                continue
            for t in p.get("targets", []):
                expr = t["expr"].replace("$__rate_interval", RATE_INTERVAL).replace("$job", ".+").replace("$namespace", ".+")
                assert "$" not in expr, f"unhandled variable in {p['title']}: {expr}"
                out.append((f"{path.stem}: {p['title']} [{t['refId']}]", expr))
    return out


@pytest.fixture()
def local_run(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """`kubetrain run` of a tiny model (2 workers, ddp, fp32, rank 1 fails once at step 20), in the background."""
    port = free_port(consecutive=2)
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "promdemo"},
        "spec": {"workers": 2, "strategy": "ddp", "precision": "fp32", "microBatchSize": 2, "maxSteps": 5000,
                 "metricsPort": port, "seed": 1,
                 "model": {"dModel": 32, "nLayers": 1, "nHeads": 2, "seqLen": 32},
                 "data": {"path": str(EXAMPLE_DATA)},
                 "checkpoint": {"everySteps": 10, "keep": 2},
                 "restartPolicy": {"backoffLimit": 2, "backoffSeconds": 0}}}))
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kubetrain.core", "run", str(manifest), "--output-dir", str(tmp_path / "out"),
             "--fresh", "-q", "--fail-at", "1:20"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, port, log
    finally:
        stop_process(proc, 30, group=True)


def rank0_reports(jobs: TrainingJobs, record: Progress) -> None:
    """What rank 0 of the job's current generation reports: its progress record on worker 0."""
    jobs.core.patch_namespaced_pod(f"{record.job}-worker-0", jobs.ns, {"metadata": {"annotations": {
        contract.PROGRESS_ANNOTATION: record.model_dump_json(by_alias=True, exclude_none=True)}}})


def operator_scenario(admin: client.ApiClient, ns: str, op: OperatorProcess) -> None:
    """Running -> a worker fails (gang restart) -> Running again -> all workers succeed."""
    jobs = TrainingJobs(admin, ns, op)
    jobs.submit(kwok_job("prom", {"workers": 2, "resources": {"gpusPerWorker": 8},
                                  "restartPolicy": {"backoffSeconds": 0, "backoffLimit": 3}}))

    def status() -> dict[str, Any]:
        return jobs.status("prom")

    def running_pods(generation: int) -> list[client.V1Pod]:
        pods = [p for p in jobs.pods("prom") if p.metadata.labels.get(contract.LABEL_GENERATION) == str(generation)]
        return pods if len(pods) == 2 and all(p.status.phase == "Running" for p in pods) else []

    try:
        wait_for(lambda: status().get("phase") == "Running", 90, what="prom Running")
        for step in (5, 6):  # rank 0 trains: the time between these two steps is productive
            rank0_reports(jobs, Progress(job="prom", step=step, max_steps=100, step_seconds=0.5))
            wait_for(lambda s=step: status().get("currentStep") == s, 60, what=f"prom at step {step}")
        fail_pod(jobs.core, ns, running_pods(0)[0].metadata.name, 137, "OOMKilled")
        wait_for(lambda: status().get("restartCount") == 1 and status().get("phase") == "Running"
                 and running_pods(1), 90, what="prom Running again after the gang restart")
        # Generation 1 resumed from scratch: steps 1-6 are redone, and the restart's downtime is lost.
        rank0_reports(jobs, Progress(job="prom", generation=1, step=1, max_steps=100, resumed_from=0, step_seconds=0.5))
        wait_for(lambda: (status().get("goodput") or {}).get("stepsLost") == 6, 60, what="prom's steps lost")
        succeed_workers(jobs.core, ns, running_pods(1))
        st = wait_for(lambda: status().get("phase") == "Succeeded" and status(), 60, what="prom Succeeded")
        print(f"prom: gpuHours {st.get('gpuHours')}, goodput {st.get('goodput')}")
        assert st.get("gpuHours", 0) > 0 and st["goodput"].get("lostGpuHours", 0) > 0, st
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{jobs.explain('prom')}") from exc


def sweep_scenario(admin: client.ApiClient, ns: str, op: OperatorProcess) -> None:
    """A one-trial TrainingSweep that completes: its trials by state and its best value are exported."""
    sweeps = TrainingSweeps(admin, ns, op)
    sweeps.submit(kwok_sweep("promsweep", maxTrials=1, parallelism=1))
    finish_trial(sweeps.jobs, "promsweep-0", 1.5)
    sweeps.wait_status("promsweep", lambda s: s.get("phase") == "Succeeded", 30, "promsweep Succeeded")


def test_prometheus_scrapes_operator_and_workers_and_every_panel_has_data(
    kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp_path: Path,
    local_run: tuple[subprocess.Popen[bytes], int, Path],
) -> None:
    run, trainer_port, run_log = local_run
    apply(admin_api, yaml.safe_load((CHART / "crds" / "kubetrain.io_trainingjobs.yaml").read_text()))
    apply_crds(admin_api, [yaml.safe_load((CHART / "crds" / "kubetrain.io_trainingsweeps.yaml").read_text())])

    op_port = free_port()
    scrape = [
        # As the chart's ServiceMonitor: the operator's per-job series keep their namespace and trainingjob.
        {"job_name": "kubetrain-operator", "honor_labels": True,
         "static_configs": [{"targets": [f"127.0.0.1:{op_port}"]}]},
        # As the chart's PodMonitor labels a worker's series from its pod (jobLabel, the trainingjob relabeling,
        # the pod's namespace), never from what the process exports (honor_labels off).
        {"job_name": "kubetrain-workers", "honor_labels": False,
         "static_configs": [{"targets": [f"127.0.0.1:{trainer_port}", f"127.0.0.1:{trainer_port + 1}"],
                             "labels": {"job": "promdemo", "trainingjob": "promdemo", "namespace": namespace}}]},
    ]
    prom = ps.start_or_skip(tmp_path, scrape, rules=ht.alert_rules())
    try:
        with OperatorProcess(kubeconfig_path(), tmp_path / "operator.log", f"--namespace={namespace}",
                                metrics_port=op_port) as op:
            # Scraped before the scenario starts, so every counter is seen rising (rates need 2 samples).
            wait_for(lambda: prom.finite('kubetrain_operator_jobs{phase="Pending"}'), 60, what="operator scraped")
            operator_scenario(admin_api, namespace, op)
            sweep_scenario(admin_api, namespace, op)

            def trainer_ready() -> bool:
                assert run.poll() is None, f"local run ended early:\n{run_log.read_text()[-3000:]}"
                # Past the injected failure at step 20: the new generation resumed (from step 10) and went on.
                return bool(prom.finite("max(kubetrain_trainer_restart_generation) >= 1")
                            and prom.finite("max(kubetrain_trainer_checkpoint_save_seconds)")
                            and prom.finite("sum(rate(kubetrain_trainer_step_seconds_count[1m])) > 0")
                            and prom.finite('kubetrain_trainer_step{job="promdemo", rank="0"} > 20'))

            wait_for(trainer_ready, 90, what="workers scraped after their restart from checkpoint")
            wait_for(lambda: prom.finite("sum(kubetrain_operator_jobs_finished_total)"), 15,
                     what="operator finished-job counter scraped")
            wait_for(lambda: prom.finite('kubetrain_operator_sweep_best_value{sweep="promsweep"}'), 15,
                     what="the sweep's best value scraped")

            targets = prom.api("targets")["activeTargets"]
            assert {t["scrapePool"] for t in targets if t["health"] == "up"} == {"kubetrain-operator", "kubetrain-workers"}
            empty = [(title, expr) for title, expr in panel_queries() if not prom.finite(expr)]
            assert not empty, "dashboard panels without data:\n" + "\n".join(f"{t}: {e}" for t, e in empty)
            for _, expr in panel_queries(gpu=True):
                prom.query(expr)  # no GPUs here: only that Prometheus accepts the query

            # Spot-check that the data is the scenario's, not just present.
            assert prom.finite('kubetrain_operator_gang_restarts_total{reason="OOMKilled"} >= 1') or prom.finite(
                "sum(kubetrain_operator_gang_restarts_total) >= 1")
            assert prom.finite('kubetrain_operator_jobs_finished_total{phase="Succeeded"} >= 1')
            for kind in ("allocated", "lost"):  # 16 GPUs from the first pod to the last, and the restart's share
                assert prom.finite(f'kubetrain_operator_job_gpu_hours{{trainingjob="prom", kind="{kind}"}} > 0'), kind
            assert prom.finite('kubetrain_operator_sweep_best_value{sweep="promsweep"} == 1.5')
            assert prom.finite('kubetrain_operator_sweep_trials{sweep="promsweep", state="Complete"} == 1')
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            assert {r["name"] for r in rules} == {"KubetrainOperatorDown", "KubetrainJobFailed",
                                                  "KubetrainRestartStorm", "KubetrainJobNoProgress"}
            assert all(r["health"] == "ok" for r in rules), rules
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nprometheus log:\n{prom.log_tail()}") from exc
    finally:
        prom.__exit__()
