"""An operator that watches several namespaces (--namespace=a,b): its own LISTs and pod watches go to each of
them, never cluster-wide (a namespaced Role allows no such LIST), and a relist of one namespace judges only
what is cached there. Namespaces by pattern (--namespace=team-*): one LIST of the cluster, filtered."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kubernetes import client
from support.fake_api import Unparsed, apis, fake_api

from kubetrain.core import api, contract
from kubetrain.operator.controller import Controller
from kubetrain.operator.jobs.cache import WatchCache
from kubetrain.operator.runtime.settings import OperatorSettings


def job(ns: str, name: str, rv: int = 1) -> dict[str, Any]:
    return {"metadata": {"namespace": ns, "name": name, "resourceVersion": str(rv)}, "status": {}}


def pod(ns: str, job_name: str, rv: int = 1) -> dict[str, Any]:
    return {"metadata": {"namespace": ns, "name": f"{job_name}-worker-0", "resourceVersion": str(rv),
                         "labels": {contract.LABEL_JOB: job_name, contract.LABEL_GENERATION: "0"}}, "spec": {}}


def a_list(items: list[dict[str, Any]], version: str = "10") -> dict[str, Any]:
    return {"items": items, "metadata": {"resourceVersion": version}}


def test_a_relist_of_one_namespace_judges_only_what_is_cached_there() -> None:
    cache = WatchCache()
    for ns in ("a", "b"):
        cache.job_event("ADDED", job(ns, "j"))
        cache.pod_event("ADDED", pod(ns, "j"))
    assert cache.jobs_missing_from([], "10", "a") == [("a", "j")]
    assert [p["metadata"]["namespace"] for p in cache.missing_from([], "10", "b")] == ["b"]
    assert len(cache.jobs_missing_from([], "10")) == 2  # a LIST of the whole cluster judges every one


def test_each_watched_namespace_is_listed_and_watched_on_its_own() -> None:
    ctl = Controller(client.ApiClient(), OperatorSettings(namespaces=("a", "b"), metrics_port=0))
    fake = fake_api()
    ctl.applier.apis, ctl.applier.sanitize = apis(fake), lambda o: o
    ctl.kueue.custom = ctl.sweeps.io.custom = fake.custom
    for watch in ctl.pod_watches:
        watch.core = fake.core
    jobs = {"a": [job("a", "kept", 5)], "b": [job("b", "j", 5)]}
    fake.custom.reply["list_namespaced_custom_object"] = lambda *args: a_list(
        jobs[args[2]] if args[3] == api.PLURAL else [])
    fake.core.reply["list_node"] = lambda *_: a_list([])
    fake.core.reply["list_namespaced_pod"] = lambda ns: Unparsed(json.dumps(a_list([pod("b", "j", 5)] if ns == "b"
                                                                                      else [])))
    try:
        ctl.job_event("ADDED", job("a", "gone", 5))  # deleted while no watch told: a's LIST lacks it
        ctl.job_event("ADDED", job("b", "j", 5))
        ctl.pod_event("ADDED", pod("b", "j", 5))
        listed = asyncio.run(ctl._fill_cache())
        assert [(p.scope, len(p.pods)) for p in listed] == [("a", 0), ("b", 1)]
        assert [w.namespace for w in ctl.pod_watches] == ["a", "b"]
        assert ctl.cache.job(("a", "gone")) is None and ctl.cache.job(("a", "kept")) is not None
        assert ctl.cache.pod(("b", "j"), "j-worker-0") is not None  # a's LIST of pods did not drop b's
        lists = [(m, args[2] if m.endswith("custom_object") else args[0])
                 for m, args in fake.calls if m.startswith("list_") and m != "list_node"]
        assert sorted(lists) == sorted([(m, ns) for ns in ("a", "b") for m in (
            "list_namespaced_custom_object",) * 3 + ("list_namespaced_pod",)])  # jobs, Workloads, sweeps; pods
    finally:
        ctl.applier.close()


def test_namespaces_by_pattern_are_listed_over_the_cluster_and_only_the_matching_jobs_kept() -> None:
    ctl = Controller(client.ApiClient(), OperatorSettings(namespaces=("team-*",), metrics_port=0))
    fake = fake_api()
    ctl.applier.apis, ctl.applier.sanitize = apis(fake), lambda o: o
    ctl.kueue.custom = ctl.sweeps.io.custom = fake.custom
    for watch in ctl.pod_watches:
        watch.core = fake.core
    sweep = {"metadata": {"namespace": "other", "name": "s", "resourceVersion": "3"}, "spec": {}}
    fake.custom.reply["list_cluster_custom_object"] = lambda *args: a_list(
        [job("team-a", "j"), job("other", "j")] if args[2] == api.PLURAL
        else [sweep] if args[2] == api.SWEEP_PLURAL else [])
    fake.core.reply["list_node"] = lambda *_: a_list([])
    fake.core.reply["list_pod_for_all_namespaces"] = lambda *_: Unparsed(json.dumps(a_list([])))
    try:
        asyncio.run(ctl._fill_cache())
        assert [w.namespace for w in ctl.pod_watches] == [None]
        assert ctl.cache.job(("team-a", "j")) is not None and ctl.cache.job(("other", "j")) is None
        assert ctl.sweeps.cache.sweep(("other", "s")) is None
        assert not [m for m, _ in fake.calls if m.startswith("list_namespaced")]
    finally:
        ctl.applier.close()
