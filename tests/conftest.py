"""Fixtures for every test tier; helpers stay in tests/support."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import objectstore


@pytest.fixture(scope="session")
def object_store_server(request: pytest.FixtureRequest,
                        tmp_path_factory: pytest.TempPathFactory) -> Iterator[objectstore.WeedServer]:
    """One SeaweedFS `weed server` (S3 gateway on loopback) for the session; skipped where it cannot be built."""
    yield from objectstore.serve(request, tmp_path_factory.mktemp("objectstore"))


@pytest.fixture
def object_store(object_store_server: objectstore.WeedServer) -> objectstore.ObjectStore:
    """A fresh bucket of its own on the session's object store, with its endpoint URL and keys."""
    return object_store_server.new_bucket()
