"""The e2e tier's gangs fork their ranks from one process that has imported torch and the trainer
(support.forkserver): the same entry point in a process of its own per rank, without paying every rank's
imports again. KUBETRAIN_TEST_FORKSERVER=0 starts each rank as a new interpreter instead."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.trainer_harness import forked_ranks


@pytest.fixture(scope="session", autouse=True)
def _forked_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with forked_ranks(tmp_path_factory.mktemp("forkserver")):
        yield
