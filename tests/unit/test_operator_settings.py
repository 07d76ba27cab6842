"""The operator's settings (kubetrain.operator.runtime.settings), from a command line and an environment."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kubetrain.operator.jobs import builders as b
from kubetrain.operator.runtime.settings import (
    DEFAULTS,
    ENV_API_BURST,
    ENV_API_QPS,
    ENV_CREATE_PARALLELISM,
    ENV_LEADER_ID,
    ENV_METRICS_PORT,
    ENV_NAMESPACE,
    ENV_POD_NAMESPACE,
    ENV_RECONCILE_WORKERS,
    ENV_TERMINATION_TAINTS,
    ENV_TRAINER_IMAGE,
    ENV_WORKER_NETWORK_POLICY,
    LeaderElection,
    OperatorSettings,
    WorkerNetworkPolicy,
    parse_settings,
    worker_network_policy,
)

DEPLOYMENT = Path(__file__).resolve().parents[2] / "charts" / "kubetrain" / "templates" / "deployment.yaml"
VALUES = Path(__file__).resolve().parents[2] / "charts" / "kubetrain" / "values.yaml"


def test_nothing_set_gives_the_defaults_and_no_leader_election() -> None:
    s = parse_settings([], {})
    assert s == OperatorSettings()
    assert (s.namespaces, s.metrics_port, s.create_parallelism, s.reconcile_workers) == ((), 8080, 32, 16)
    assert s.builders == b.WorkerSettings() and s.leader_election is None


def test_the_environment_the_chart_sets_is_read() -> None:
    env = {ENV_TRAINER_IMAGE: "registry.local/trainer:1", ENV_METRICS_PORT: "0", ENV_CREATE_PARALLELISM: "64",
           ENV_RECONCILE_WORKERS: "4", ENV_NAMESPACE: "ml", ENV_API_QPS: "12.5", ENV_API_BURST: "25"}
    s = parse_settings([], env)
    assert s.builders.trainer_image == "registry.local/trainer:1"
    assert (s.metrics_port, s.create_parallelism, s.reconcile_workers, s.namespaces) == (0, 64, 4, ("ml",))
    assert (s.api_qps, s.api_burst) == (12.5, 25)


def test_the_chart_sets_the_same_names_with_the_same_defaults() -> None:
    template = DEPLOYMENT.read_text()
    for name in (ENV_TRAINER_IMAGE, ENV_METRICS_PORT, ENV_CREATE_PARALLELISM, ENV_RECONCILE_WORKERS,
                 ENV_POD_NAMESPACE, ENV_WORKER_NETWORK_POLICY, ENV_API_QPS, ENV_API_BURST, ENV_TERMINATION_TAINTS):
        assert f"- name: {name}\n" in template
    values = yaml.safe_load(VALUES.read_text())
    assert values["operator"]["createParallelism"] == DEFAULTS.create_parallelism
    assert values["operator"]["reconcileWorkers"] == DEFAULTS.reconcile_workers
    assert (values["operator"]["apiQPS"], values["operator"]["apiBurst"]) == (DEFAULTS.api_qps, DEFAULTS.api_burst)
    assert values["metrics"]["port"] == DEFAULTS.metrics_port
    assert tuple(values["nodeTermination"]["taints"]) == DEFAULTS.termination_taints
    assert "--leader-elect-lease={{ .Values.leaderElection.leaseName }}" in template


def test_termination_taints_come_comma_separated_and_empty_turns_them_off() -> None:
    assert parse_settings([], {ENV_TERMINATION_TAINTS: "a/spot, b"}).termination_taints == ("a/spot", "b")
    assert parse_settings([], {ENV_TERMINATION_TAINTS: ""}).termination_taints == ()


def test_the_namespace_flag_wins_over_the_environment() -> None:
    assert parse_settings(["--namespace", "a"], {ENV_NAMESPACE: "b"}).namespaces == ("a",)
    assert parse_settings([], {ENV_NAMESPACE: ""}).namespaces == ()


def test_several_namespaces_come_comma_separated_or_as_repeated_flags_in_order_each_once() -> None:
    assert parse_settings(["--namespace=b,a"], {}).namespaces == ("b", "a")
    assert parse_settings(["--namespace", "b", "--namespace", "a, c,,b"], {}).namespaces == ("b", "a", "c")
    assert parse_settings([], {ENV_NAMESPACE: " team-a,team-b ,"}).namespaces == ("team-a", "team-b")
    assert parse_settings(["--namespace="], {ENV_NAMESPACE: "x"}).namespaces == ()  # an empty flag: every one


def test_the_operators_lists_and_watches_go_to_each_namespace_or_to_the_whole_cluster() -> None:
    assert OperatorSettings(namespaces=("a", "b")).scopes() == ("a", "b")
    assert OperatorSettings().scopes() == (None,)
    assert OperatorSettings(namespaces=("a", "ml-*")).scopes() == (None,)  # a pattern: the cluster, filtered


def test_namespaces_by_pattern_keep_only_the_namespaces_that_match() -> None:
    s = parse_settings(["--namespace=team-*,ci-?-x,infra"], {})
    assert s.namespaces == ("team-*", "ci-?-x", "infra") and s.patterns() == ("team-*", "ci-?-x")
    assert [n for n in ("team-a", "team-", "ci-1-x", "ci-12-x", "infra", "infra-2", "teams")
            if s.watches(n)] == ["team-a", "team-", "ci-1-x", "infra"]
    assert OperatorSettings().watches("anything") and OperatorSettings(namespaces=("a",)).watches("a")
    assert not OperatorSettings(namespaces=("a",)).watches("b")


def test_a_leader_lease_is_never_put_in_a_pattern() -> None:
    named = parse_settings(["--leader-elect", "--namespace=team-*,ops"], {}).leader_election
    assert named is not None and named.namespace == "ops"
    only_patterns = parse_settings(["--leader-elect", "--namespace=team-*"], {}).leader_election
    assert only_patterns is not None and "*" not in only_patterns.namespace


@pytest.mark.parametrize("given", ["!ml-*", "ml-[ab]", "Team", "a_b", "-a", "x" * 64, "*" * 64])
def test_a_name_that_is_no_namespaces_is_refused(given: str) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings([f"--namespace=ok,{given}"], {})
    assert exc.value.code == 2
    with pytest.raises(ValueError, match="not a namespace's name nor a pattern"):
        OperatorSettings(namespaces=(given,))
    with pytest.raises(ValueError, match="twice"):
        OperatorSettings(namespaces=("a", "a"))


def test_leader_election_takes_the_lease_in_the_pods_namespace_by_default() -> None:
    s = parse_settings(["--leader-elect"], {ENV_POD_NAMESPACE: "ops", ENV_LEADER_ID: "replica-a"})
    assert s.leader_election == LeaderElection(namespace="ops", lease="kubetrain-operator", identity="replica-a")
    s = parse_settings(["--leader-elect", "--namespace", "ml,dev"], {})
    assert s.leader_election is not None and s.leader_election.namespace == "ml"  # the first watched
    s = parse_settings(["--leader-elect", "--leader-elect-lease", "l", "--leader-elect-namespace", "x"],
                       {ENV_POD_NAMESPACE: "ops"})
    assert s.leader_election is not None and (s.leader_election.namespace, s.leader_election.lease) == ("x", "l")


def test_each_replica_gets_its_own_identity() -> None:
    one, two = (parse_settings(["--leader-elect"], {}).leader_election for _ in range(2))
    assert one is not None and two is not None and one.identity and one.identity != two.identity


@pytest.mark.parametrize("env", [{ENV_METRICS_PORT: "eighty"}, {ENV_METRICS_PORT: "70000"},
                                 {ENV_RECONCILE_WORKERS: "0"}, {ENV_CREATE_PARALLELISM: "-1"}])
def test_a_bad_value_stops_the_operator_with_a_usage_error(env: dict[str, str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings([], env)
    assert exc.value.code == 2


def test_settings_are_frozen_and_lease_timings_consistent() -> None:
    with pytest.raises(AttributeError):
        DEFAULTS.reconcile_workers = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="renew_deadline"):
        LeaderElection(identity="a", duration=5, renew_deadline=10.0)
    with pytest.raises(ValueError, match="identity"):
        LeaderElection()


MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_the_worker_network_policy_is_off_unless_enabled() -> None:
    assert DEFAULTS.builders.network_policy is None
    assert parse_settings([], {ENV_WORKER_NETWORK_POLICY: '{"enabled": false, "metricsFrom": []}'}
                          ).builders.network_policy is None
    on = parse_settings([], {ENV_WORKER_NETWORK_POLICY: json.dumps({"enabled": True, "metricsFrom": [MONITORING]})})
    assert on.builders.network_policy == WorkerNetworkPolicy(metrics_from=(MONITORING,))
    assert worker_network_policy('{"enabled": true}') == WorkerNetworkPolicy()


@pytest.mark.parametrize(("raw", "says"), [
    ("yes", "is not JSON"),
    ("[true]", "JSON object with the keys enabled and metricsFrom"),
    ('{"enable": true}', "JSON object with the keys enabled and metricsFrom"),
    ('{"enabled": "true"}', "enabled must be true or false"),
    ('{"enabled": true, "metricsFrom": {"podSelector": {}}}', "metricsFrom must be a list of NetworkPolicyPeers"),
    ('{"enabled": true, "metricsFrom": [{"namespace": "monitoring"}]}', "podSelector, namespaceSelector, ipBlock"),
    ('{"enabled": true, "metricsFrom": [{}]}', "metricsFrom must be a list"),
])
def test_a_bad_worker_network_policy_is_refused_naming_what_is_wrong(
        raw: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        worker_network_policy(raw)
    with pytest.raises(SystemExit) as exc:
        parse_settings([], {ENV_WORKER_NETWORK_POLICY: raw})
    assert exc.value.code == 2 and ENV_WORKER_NETWORK_POLICY in capsys.readouterr().err
