"""`--workdir DIR`: a directory shipped with a job and unpacked into every worker's working directory.

`kubetrain submit FILE --workdir DIR` packs DIR into a gzipped tar (:func:`pack`: deterministic, so the same tree
gives the same archive and name) and stores it in a ConfigMap `<job>-workdir-<digest>` (immutable, owned by the
job once it exists); spec.workdir.configMap names it. In every worker pod the init container `kubetrain-workdir` unpacks
it into an emptyDir mounted at WORKDIR_MOUNT, the trainer container's working directory, before the command
runs: a relative command or data.path resolves there, as `kubetrain run --workdir DIR` resolves it in DIR.
Editing a script and submitting again ships the new tree; no image is built.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from pathlib import Path
from typing import Any

from kubetrain.core import contract

MAX_ARCHIVE_BYTES = 900 * 1024
"""The most a packed tree may weigh: a ConfigMap holds at most 1 MiB (etcd's object limit), with room left for
its metadata."""
SKIPPED = frozenset({"__pycache__", "venv", "runs"})
"""Directory names never shipped besides hidden ones (.git, .venv, .env, ...): caches, virtualenvs, local runs'
outputs."""
SKIPPED_SUFFIXES = (".pyc", ".pyo")


class WorkdirError(ValueError):
    """DIR cannot be shipped; the message says why and what to do."""


def shipped_files(root: Path) -> list[Path]:
    """The regular files under ``root`` that are shipped, sorted; symbolic links are refused (their targets are
    not in the tree a pod gets)."""
    if not root.is_dir():
        raise WorkdirError(f"--workdir {root}: not a directory")
    found: list[Path] = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        hidden = any(part.startswith(".") for part in rel.parts)  # .env, .aws/: secrets have no place in a ConfigMap
        if hidden or any(part in SKIPPED for part in rel.parts) or path.suffix in SKIPPED_SUFFIXES:
            continue
        if path.is_symlink():
            raise WorkdirError(f"--workdir {root}: {rel} is a symbolic link; ship the file itself")
        if path.is_file():
            found.append(path)
    return found


def pack(root: Path) -> bytes:
    """DIR as a gzipped tar of its shipped files (relative paths, mode kept, owner and time zeroed): the same tree
    packs to the same bytes. Raises WorkdirError above MAX_ARCHIVE_BYTES."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in shipped_files(root):
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            info.size, info.mode = path.stat().st_size, path.stat().st_mode & 0o755
            with path.open("rb") as f:
                tar.addfile(info, f)
    archive = gzip.compress(raw.getvalue(), mtime=0)
    if len(archive) > MAX_ARCHIVE_BYTES:
        raise WorkdirError(f"--workdir {root}: packs to {len(archive) / 1024:.0f} KiB, above the "
                           f"{MAX_ARCHIVE_BYTES // 1024} KiB a ConfigMap holds: keep code in it and put data and "
                           "models in a volume or object storage (data.uri, model.hfUri)")
    return archive


def config_map_name(job: str, archive: bytes) -> str:
    """`<job>-workdir-<first 10 hex of the archive's sha256>`: a new tree is a new ConfigMap, never an edit of the
    one a running job's pods mount."""
    return f"{job}-workdir-{hashlib.sha256(archive).hexdigest()[:10]}"


def config_map(name: str, namespace: str, job: str, archive: bytes) -> dict[str, Any]:
    """The immutable ConfigMap holding ``archive``, labelled with its job."""
    import base64  # noqa: PLC0415

    return {
        "apiVersion": "v1", "kind": "ConfigMap", "immutable": True,
        "metadata": {"name": name, "namespace": namespace, "labels": {contract.LABEL_JOB: job}},
        "binaryData": {contract.WORKDIR_ARCHIVE: base64.b64encode(archive).decode()},
    }


_ARCHIVE = f"{contract.WORKDIR_ARCHIVE_MOUNT}/{contract.WORKDIR_ARCHIVE}"
UNPACK_SOURCE = f"""\
import sys, tarfile
archive, dest = {_ARCHIVE!r}, {contract.WORKDIR_MOUNT!r}
with tarfile.open(archive) as tar:
    members = tar.getmembers()
    bad = [m.name for m in members if not m.isfile() or m.name.startswith("/") or ".." in m.name.split("/")]
    if bad:
        sys.exit("workdir: refusing to unpack " + ", ".join(bad[:3]) + ": not a plain relative file")
    safe = dict(filter="data") if hasattr(tarfile, "data_filter") else dict()  # Python 3.11.4+: a second guard
    tar.extractall(dest, members=members, **safe)
print("workdir: unpacked", len(members), "files into", dest)
"""
"""`python3 -c` of the init container `kubetrain-workdir`: standard library only, so any image with a python3 runs it."""
