"""Fixtures for every test tier, and the suite's order and build progress; helpers stay in tests/support.

Order: unit, then e2e, then integration (pytest would collect them alphabetically: e2e first), and the
Kueue tests at the end of theirs. The tests that need nothing built run while hack/prebuild.sh builds in
the background (.ci/run, `make test`): S3Proxy for the e2e tier first, the cluster for the integration
tier (the run's long pole) next, then helm, whose tests run at the end of their tier (the unit tier's after
the e2e tier), Kueue last. Each line the background build adds to
its progress file (a part started or finished, with what is left) is printed in the test log between tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support import builds, cpu_usage, helm_tool, lanes, objectstore

TIERS = {"unit": 0, "e2e": 1, "integration": 2}
BUILT_LAST = ("helm_ok", "kueue")
"""Fixtures whose binary hack/prebuild.sh builds after the cluster's parts, in this order: the modules that use
them run at the end of their tier, in this order, and the unit tier's after the e2e tier."""


def _tier(item: pytest.Item) -> int:
    try:
        parts = Path(item.path).relative_to(item.config.rootpath).parts  # tests/<tier>/...
    except ValueError:
        return TIERS["e2e"]
    return TIERS.get(parts[1] if len(parts) > 2 else "", TIERS["e2e"])


def pytest_addoption(parser: pytest.Parser) -> None:
    cpu_usage.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    builds.register(config)
    cpu_usage.register(config)


def pytest_report_header() -> list[str]:
    return builds.prebuild_status().splitlines() if builds.prebuild_running() else []


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """unit, e2e, integration, and within a tier the modules that need a part built last after the others, and
    the tests a lane takes over from another after all of its own (support/lanes.py).
    A stable sort by whole modules: each keeps pytest's own order, and module-scoped fixtures run once."""
    late: dict[Path, int] = {}
    for item in items:
        late[item.path] = max(late.get(item.path, 0), _built_last(item))

    def key(item: pytest.Item) -> tuple[int, bool, int]:
        tier = _tier(item)
        if tier == TIERS["unit"] and late[item.path]:
            tier = TIERS["e2e"]
        return tier, item.stash.get(lanes.TAKEN_OVER, False), late[item.path]

    items.sort(key=key)


def _built_last(item: pytest.Item) -> int:
    """0, or 1 + the index in BUILT_LAST of the last-built part the test needs."""
    names = set(getattr(item, "fixturenames", ()))
    return max((i + 1 for i, fixture in enumerate(BUILT_LAST) if fixture in names), default=0)


def pytest_runtest_logfinish() -> None:
    builds.report_progress()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    builds.report_progress()
    lines = builds.summary_lines()
    if lines:
        terminalreporter.section("background build (hack/prebuild.sh)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def helm_ok() -> None:
    """helm from hack/helm (built on first use, or awaited while the background build makes it); skips where it
    cannot be had (no Go)."""
    helm_tool.require_helm()


@pytest.fixture(scope="session")
def object_store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[objectstore.ObjectStoreServer]:
    """One S3Proxy server (S3 on loopback) for the session; skipped where it cannot be fetched or run."""
    yield from objectstore.serve(tmp_path_factory.mktemp("objectstore"))


@pytest.fixture
def object_store(object_store_server: objectstore.ObjectStoreServer) -> objectstore.ObjectStore:
    """A fresh bucket of its own on the session's object store, with its endpoint URL and keys."""
    return object_store_server.new_bucket()
