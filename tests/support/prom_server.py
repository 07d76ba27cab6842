"""A real Prometheus server (Debian's package, started by hack/prometheus.sh) for the tests."""

from __future__ import annotations

import json
import math
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from .paths import HACK_DIR
from .ports import free_port

SCRIPT = HACK_DIR / "prometheus.sh"


class PrometheusUnavailable(RuntimeError):
    """prometheus is not installed and could not be installed."""


class Prometheus:
    """`prometheus` on 127.0.0.1:<port> with a generated config; use as a context manager."""

    def __init__(self, workdir: Path, scrape_configs: list[dict[str, Any]], rules: dict[str, Any] | None = None,
                 scrape_interval: str = "1s"):
        self.dir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config: dict[str, Any] = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": scrape_configs,
        }
        if rules is not None:
            (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
            config["rule_files"] = [str(workdir / "rules.yaml")]
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))

    def __enter__(self) -> Prometheus:
        proc = subprocess.run([str(SCRIPT), "start", str(self.dir), str(self.config), str(self.port)],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise PrometheusUnavailable(proc.stderr[-2000:])
        return self

    def __exit__(self, *_: object) -> None:
        subprocess.run([str(SCRIPT), "stop", str(self.dir)], capture_output=True, timeout=30)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as rsp:
            body = json.load(rsp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def finite(self, expr: str) -> list[dict[str, Any]]:
        """The series of an instant query whose value is a finite number (NaN/Inf dropped)."""
        return [r for r in self.query(expr) if math.isfinite(float(r["value"][1]))]

    def log_tail(self) -> str:
        log = self.dir / "prometheus.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""


def start_or_skip(workdir: Path, scrape_configs: list[dict[str, Any]], rules: dict[str, Any] | None = None
                  ) -> Prometheus:
    """A started Prometheus (stop it with ``__exit__``), or skip the test where there is none to be had."""
    try:
        return Prometheus(workdir, scrape_configs, rules).__enter__()
    except PrometheusUnavailable as exc:
        pytest.skip(f"no Prometheus: {exc}")
