"""--cpu-durations (tests/support/cpu_usage.py): the tests ranked by the CPU they and their reaped children used."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from support import cpu_usage
from support.paths import REPO_ROOT

CONFTEST = """
from support import cpu_usage

def pytest_addoption(parser):
    cpu_usage.add_option(parser)

def pytest_configure(config):
    cpu_usage.register(config)
"""

MODULE = """
import subprocess, sys

def test_idle():
    pass

def test_child_busy():
    # CPU, not wall time: a fixed amount of work, however loaded the machine
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
"""


def run_pytest(where: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "tests")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=where, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_child_process_s_cpu_counts_for_the_test_that_ran_it(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_work.py").write_text(MODULE)
    out = run_pytest(tmp_path, "--cpu-durations=0")
    rows = re.findall(r"^\s*([0-9.]+)s  (test_work\.py::\w+)$", out, re.MULTILINE)
    assert [name for _, name in rows] == ["test_work.py::test_child_busy", "test_work.py::test_idle"], out
    busy, idle = (float(seconds) for seconds, _ in rows)
    assert busy >= idle + 0.1, out
    assert re.search(r"^\s*[0-9.]+s  in all, 2 tests$", out, re.MULTILINE), out


def test_without_the_option_nothing_is_measured_or_shown(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_work.py").write_text(MODULE)
    assert "using the most CPU" not in run_pytest(tmp_path)


def test_the_n_costliest_come_first_and_the_total_counts_them_all() -> None:
    spent = {"a": 1.0, "b": 3.0, "c": 2.0}
    assert cpu_usage.top_lines(spent, 2) == ["     3.0s  b", "     2.0s  c", "     6.0s  in all, 3 tests"]
    assert len(cpu_usage.top_lines(spent, 0)) == 4
