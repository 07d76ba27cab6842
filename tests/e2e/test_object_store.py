"""The tests' S3-compatible object store (S3Proxy, tests/support/objectstore.py) through s3fs,
the client the trainer uses for s3:// checkpoints."""

from __future__ import annotations

import pytest
from support.objectstore import ObjectStore

pytestmark = pytest.mark.e2e


def test_objects_put_list_and_get_back_through_s3fs(object_store: ObjectStore) -> None:
    fs = object_store.filesystem()
    fs.pipe({object_store.url("ckpt", "step-2", "a.bin"): b"\x00\x01" * 70_000,
             object_store.url("ckpt", "step-2", ".metadata"): b"done"})

    assert sorted(fs.ls(object_store.url("ckpt", "step-2"), detail=False)) == [
        f"{object_store.bucket}/ckpt/step-2/.metadata", f"{object_store.bucket}/ckpt/step-2/a.bin"]
    assert fs.cat(object_store.url("ckpt", "step-2", "a.bin")) == b"\x00\x01" * 70_000
    assert fs.cat(object_store.url("ckpt", "step-2", ".metadata")) == b"done"


def test_a_wrong_secret_key_is_refused(object_store: ObjectStore) -> None:
    intruder = object_store.filesystem(secret_key="not-" + object_store.secret_key)

    with pytest.raises(PermissionError) as refused:
        intruder.ls(object_store.bucket)

    cause = refused.value.__cause__  # botocore's ClientError, with the HTTP answer
    assert getattr(cause, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") == 403, repr(cause)
