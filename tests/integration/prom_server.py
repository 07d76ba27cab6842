"""A real Prometheus server (Debian's package, started by hack/prometheus.sh) for the tests."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "hack" / "prometheus.sh"


class PrometheusUnavailable(RuntimeError):
    """prometheus is not installed and could not be installed."""


def free_port(consecutive: int = 1) -> int:
    """A loopback port (and the ``consecutive - 1`` after it) that nothing listens on right now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + consecutive > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + consecutive):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


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
