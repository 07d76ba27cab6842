"""Build the operator image from the root Dockerfile with Debian's buildah, on a locally made base.

No container registry is reachable here, so `FROM python:…-slim` cannot be pulled. The build uses
the same Dockerfile with `--build-arg PYTHON_IMAGE=localhost/kubetrain-base:bookworm`: a Debian
bookworm rootfs made with debootstrap (python3, python3-venv, python-is-python3). The host's CA
bundle goes into that base so pip inside the build reaches PyPI the way the host does. buildah runs
with the vfs storage driver and chroot isolation (no daemon, no user namespaces needed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/kubetrain-base:bookworm"
OPERATOR = "localhost/kubetrain-operator:test"
BUILDAH = ["buildah", "--storage-driver", "vfs"]


def unavailable() -> str | None:
    """Why the image cannot be built here, or None."""
    missing = [t for t in ("buildah", "debootstrap") if shutil.which(t) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install buildah debootstrap)"
    if os.geteuid() != 0:
        return "buildah with chroot isolation and debootstrap need root here"
    return None


def _run(*cmd: str, timeout: float = 900) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def has_image(name: str) -> bool:
    return subprocess.run([*BUILDAH, "inspect", "--type", "image", name], capture_output=True).returncode == 0


def ensure_base() -> None:
    if has_image(BASE):
        return
    with tempfile.TemporaryDirectory(prefix="kubetrain-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run("debootstrap", "--variant=minbase", "--include=python3,python3-venv,python-is-python3,ca-certificates",
             "bookworm", str(rootfs), "http://deb.debian.org/debian")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (rootfs / junk).glob("*"):
                if f.is_file():
                    f.unlink()
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", rootfs / "etc/ssl/certs/ca-certificates.crt")
        ctr = _run(*BUILDAH, "from", "scratch").strip()
        try:
            mnt = _run(*BUILDAH, "mount", ctr).strip()
            _run("cp", "-a", f"{rootfs}/.", mnt)
            _run(*BUILDAH, "config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", ctr)
            _run(*BUILDAH, "commit", "-q", ctr, BASE)
        finally:
            subprocess.run([*BUILDAH, "rm", ctr], capture_output=True)


def build_operator() -> str:
    """Build (layers cached between runs) and return the image name."""
    ensure_base()
    _run(*BUILDAH, "bud", "--isolation", "chroot", "--network", "host", "--layers",
         "--build-arg", f"PYTHON_IMAGE={BASE}", "-f", str(REPO_ROOT / "Dockerfile"), "-t", OPERATOR, str(REPO_ROOT))
    return OPERATOR


def inspect(image: str, fmt: str) -> str:
    return _run(*BUILDAH, "inspect", "--type", "image", "--format", fmt, image).strip()


class Container:
    """A working container of ``image``; `run` executes a command in it (chroot isolation, host network)."""

    def __init__(self, image: str):
        self.image = image
        self.name = ""

    def __enter__(self) -> Container:
        self.name = _run(*BUILDAH, "from", self.image).strip()
        return self

    def __exit__(self, *_: object) -> None:
        subprocess.run([*BUILDAH, "rm", self.name], capture_output=True)

    def command(self, *cmd: str, user: str = "65532:65532", env: dict[str, str] | None = None,
                volumes: dict[Path, str] | None = None) -> list[str]:
        args = [*BUILDAH, "run", "--isolation", "chroot", "--network", "host", "--user", user]
        for k, v in (env or {}).items():
            args += ["--env", f"{k}={v}"]
        for host, inside in (volumes or {}).items():
            args += ["-v", f"{host}:{inside}:ro"]
        return [*args, self.name, "--", *cmd]

    def run(self, *cmd: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(*cmd, **kw), capture_output=True, text=True, timeout=120)  # type: ignore[arg-type]
