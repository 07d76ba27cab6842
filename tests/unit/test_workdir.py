"""--workdir: the directory packed into a ConfigMap, unpacked by a worker pod's init container, and worked in."""

import gzip
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kubetrain.core import contract, workdir
from kubetrain.core.api import TrainingJob
from kubetrain.operator.jobs import builders as b


def tree(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('v1')\n")
    (root / "pkg" / "util.py").write_text("X = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    for skipped in (".git/HEAD", "__pycache__/train.cpython-311.pyc", "runs/job/progress.json", ".venv/pyvenv.cfg",
                    ".env", ".aws/credentials"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("x")
    return root


def names(archive: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return tar.getnames()


def test_a_tree_packs_to_the_same_bytes_without_hidden_files_caches_or_runs(tmp_path):
    root = tree(tmp_path / "a")
    first = workdir.pack(root)
    os.utime(root / "train.py", (1, 1))  # times are not shipped: the same tree is the same ConfigMap
    assert workdir.pack(root) == first
    assert names(first) == ["pkg/util.py", "run.sh", "train.py"]
    (root / "train.py").write_text("print('v2')\n")
    assert workdir.config_map_name("llm", workdir.pack(root)) != workdir.config_map_name("llm", first)
    assert workdir.config_map_name("llm", first).startswith("llm-workdir-")


def test_what_cannot_be_shipped_is_refused_with_the_reason(tmp_path):
    root = tree(tmp_path / "a")
    (root / "link.py").symlink_to(root / "train.py")
    with pytest.raises(workdir.WorkdirError, match="link.py is a symbolic link"):
        workdir.pack(root)
    (root / "link.py").unlink()
    (root / "weights.bin").write_bytes(os.urandom(workdir.MAX_ARCHIVE_BYTES + 1))
    with pytest.raises(workdir.WorkdirError, match=r"above the 900 KiB a ConfigMap holds"):
        workdir.pack(root)
    with pytest.raises(workdir.WorkdirError, match="not a directory"):
        workdir.pack(root / "train.py")


def unpack(tmp_path: Path, archive: bytes) -> subprocess.CompletedProcess[str]:
    """The init container's own source, run by this interpreter with its two paths moved under tmp_path."""
    (tmp_path / "cm").mkdir()
    (tmp_path / "cm" / contract.WORKDIR_ARCHIVE).write_bytes(archive)
    source = workdir.UNPACK_SOURCE.replace(contract.WORKDIR_ARCHIVE_MOUNT, str(tmp_path / "cm")).replace(
        contract.WORKDIR_MOUNT, str(tmp_path / "work"))
    return subprocess.run([sys.executable, "-S", "-c", source], capture_output=True, text=True, timeout=30)


def test_the_init_container_unpacks_the_tree_with_its_modes(tmp_path):
    done = unpack(tmp_path, workdir.pack(tree(tmp_path / "a")))
    assert done.returncode == 0, done.stderr
    assert "unpacked 3 files" in done.stdout
    assert (tmp_path / "work" / "train.py").read_text() == "print('v1')\n"
    assert os.access(tmp_path / "work" / "run.sh", os.X_OK) and (tmp_path / "work" / "pkg" / "util.py").is_file()


def test_the_init_container_refuses_an_archive_that_escapes(tmp_path):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("../evil.py")
        tar.addfile(info, io.BytesIO(b""))
    done = unpack(tmp_path, gzip.compress(raw.getvalue()))
    assert done.returncode != 0 and "refusing to unpack ../evil.py" in done.stderr
    assert not (tmp_path / "evil.py").exists()


def test_a_worker_pod_works_in_the_unpacked_tree():
    job = TrainingJob.model_validate({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                      "metadata": {"name": "llm", "namespace": "team-a"},
                                      "spec": {"command": ["python", "train.py"], "workdir": {"configMap": "llm-wd"}}})
    pod = b.worker_pod(job, 0, 0, b.WorkerSettings(), None)["spec"]
    trainer, first = pod["containers"][0], pod["initContainers"][0]
    assert trainer["workingDir"] == contract.WORKDIR_MOUNT
    assert {"name": "kubetrain-workdir", "mountPath": contract.WORKDIR_MOUNT} in trainer["volumeMounts"]
    assert first["name"] == contract.WORKDIR_CONTAINER and first["image"] == trainer["image"]
    assert first["command"] == ["python3", "-c", workdir.UNPACK_SOURCE]
    assert first["securityContext"] == trainer["securityContext"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kubetrain-workdir-archive"]["configMap"] == {"name": "llm-wd"}
    assert volumes["kubetrain-workdir"] == {"name": "kubetrain-workdir", "emptyDir": {}}
