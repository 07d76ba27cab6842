"""The chart's alert rules pass `promtool check rules` and the promtool unit tests in
charts/kubetrain/tests/alerts_test.yaml (promtool from Debian's prometheus package, hack/prometheus.sh)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support import helm_tool as ht
from support.paths import CHART, HACK_DIR


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory: pytest.TempPathFactory, helm_ok: None) -> Path:
    if shutil.which("promtool") is None:
        proc = subprocess.run([str(HACK_DIR / "prometheus.sh"), "install"], capture_output=True, text=True)
        if proc.returncode != 0 or shutil.which("promtool") is None:
            pytest.skip(f"promtool not installed and hack/prometheus.sh install failed: {proc.stderr[-500:]}")
    d = tmp_path_factory.mktemp("rules")
    (d / "alerts.rules.yaml").write_text(yaml.safe_dump(ht.alert_rules(), sort_keys=False))
    shutil.copy(CHART / "tests" / "alerts_test.yaml", d / "alerts_test.yaml")
    return d


def _promtool(rules_dir: Path, *args: str) -> str:
    proc = subprocess.run(["promtool", *args], cwd=rules_dir, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"promtool {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def test_promtool_check_rules(rules_dir: Path) -> None:
    out = _promtool(rules_dir, "check", "rules", "alerts.rules.yaml")
    assert "SUCCESS: 4 rules found" in out


def test_promtool_test_rules(rules_dir: Path) -> None:
    out = _promtool(rules_dir, "test", "rules", "alerts_test.yaml")
    assert "SUCCESS" in out


def test_every_alert_has_a_promtool_test(rules_dir: Path) -> None:
    alerts = {r["alert"] for g in ht.alert_rules()["groups"] for r in g["rules"]}
    assert alerts == {"KubetrainOperatorDown", "KubetrainJobFailed", "KubetrainRestartStorm", "KubetrainJobNoProgress"}
    tests = yaml.safe_load((rules_dir / "alerts_test.yaml").read_text())["tests"]
    tested = {a["alertname"] for t in tests for a in t["alert_rule_test"] if a["exp_alerts"]}
    assert tested == alerts


def test_thresholds_come_from_values(rules_dir: Path) -> None:
    rules = ht.alert_rules({"metrics.prometheusRule.restartStormThreshold": 5,
                            "metrics.prometheusRule.noProgressFor": "30m"})
    exprs = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    assert exprs["KubetrainRestartStorm"].endswith(">= 5")
    assert "kubetrain_trainer_step[30m]" in exprs["KubetrainJobNoProgress"]
