#!/usr/bin/env python3
"""Write a one-layer OCI image archive from files on this machine, for `ctr images import`.

    hack/oci-image.py OUT.tar REPO:TAG --entrypoint /pause  DEST=SRC [DEST=SRC ...] [DEST@LINK ...]

DEST=SRC copies the file SRC to DEST (mode kept); DEST@TARGET makes DEST a symlink to TARGET.
Used for the test node's small images (the pod sandbox, the volume helper) so they need no
registry and no image builder. Import with `ctr images import --base-name REPO OUT.tar`.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile


def _layer(entries: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for entry in entries:
            link = "@" in entry and "=" not in entry
            dest, src = entry.split("@" if link else "=", 1)
            dest = dest.lstrip("/")
            parts = dest.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
            if link:
                info = tarfile.TarInfo(dest)
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, src, 0o777
                tar.addfile(info)
            else:
                info = tar.gettarinfo(src, arcname=dest)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                with open(src, "rb") as f:
                    tar.addfile(info, f)
    return buf.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo("blobs/sha256/" + digest.split(":")[1])
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return digest, len(data)


def main(argv: list[str]) -> None:
    out, name = argv[0], argv[1]
    assert argv[2] == "--entrypoint", __doc__
    entrypoint, entries = argv[3], argv[4:]
    layer = _layer(entries)
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": [entrypoint], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }).encode()
    with tarfile.open(out, "w") as tar:
        cfg_digest, cfg_size = _blob(tar, config)
        _, layer_size = _blob(tar, layer)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": cfg_size},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest,
                        "size": layer_size}],
        }).encode()
        man_digest, man_size = _blob(tar, manifest)
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man_digest, "size": man_size,
            "annotations": {"org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}}]}).encode()
        for fname, data in (("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'), ("index.json", index)):
            info = tarfile.TarInfo(fname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main(sys.argv[1:])
