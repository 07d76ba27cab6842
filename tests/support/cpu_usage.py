"""CPU seconds per test (``--cpu-durations=N``): what a test cost the machine, where ``--durations`` says how long
it took. On a machine whose cores the suite's lanes share, a test's wall time is mostly the others' load; its CPU
is what it adds to everyone's.

Counted from the pytest process's own CPU time and its reaped children's (getrusage RUSAGE_SELF and
RUSAGE_CHILDREN, user + system) around setup, call and teardown: a trainer gang a test starts and waits for is
counted, with the ranks its launcher waited for; a pod's processes (the kubelet's children) and a process still
running when the test ends are not. A module-scoped fixture's cost falls on the first test that uses it.
"""

from __future__ import annotations

import resource
from collections.abc import Generator

import pytest

from .forkserver import reaped_cpu_seconds

OPTION = "--cpu-durations"


def cpu_seconds() -> float:
    """User + system CPU of this process, of its children reaped so far and of the ranks a fork server forked
    for it and reaped (support.forkserver)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + reaped_cpu_seconds()


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(OPTION, type=int, default=None, metavar="N",
                     help="show the N tests that used the most CPU (pytest's process and the child processes it "
                          "reaped; 0: all)")


def top_lines(spent: dict[str, float], n: int) -> list[str]:
    """The n costliest tests (all for n == 0), costliest first, then the total."""
    ranked = sorted(spent.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = ranked if n == 0 else ranked[:n]
    lines = [f"{seconds:8.1f}s  {nodeid}" for nodeid, seconds in shown]
    return [*lines, f"{sum(spent.values()):8.1f}s  in all, {len(spent)} tests"]


class CpuUsage:
    """The plugin: registered only with the option."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.spent: dict[str, float] = {}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        before = cpu_seconds()
        try:
            return (yield)
        finally:
            self.spent[item.nodeid] = self.spent.get(item.nodeid, 0.0) + cpu_seconds() - before

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.section(f"{'all' if self.n == 0 else f'the {self.n}'} tests using the most CPU")
        for line in top_lines(self.spent, self.n):
            terminalreporter.write_line(line)


def register(config: pytest.Config) -> None:
    """pytest_configure: the plugin, where the option asks for it."""
    n = config.getoption(OPTION, default=None)
    if n is not None:
        config.pluginmanager.register(CpuUsage(int(n)), "kubetrain-cpu-usage")
