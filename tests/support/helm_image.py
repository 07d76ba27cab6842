"""The operator and trainer images as `make images` builds them, for the image tests.

hack/images.sh is the one way they are built here (no registry is reachable): buildah builds the
repository's Dockerfiles on local Debian bases and loads the result into the real node's containerd
under the chart's default names. This module drives that script: it builds, names the images,
inspects them in buildah's storage (`hack/images.sh buildah ...`) and runs them either as a buildah
container (chroot, host network: reaches the test API server on loopback) or, as a pod would, from
the node's containerd (`hack/images.sh ctr run ...`).
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

from .paths import HACK_DIR
from .processes import run_checked

SCRIPT = str(HACK_DIR / "images.sh")
BUILDAH = ["bash", SCRIPT, "buildah"]
CTR = ["bash", SCRIPT, "ctr"]


def names() -> dict[str, str]:
    """{"operator": ..., "trainer": ...}: the chart's default image names the script builds."""
    return dict(line.split() for line in run_checked(["bash", SCRIPT, "names"]).stdout.splitlines())


def build(which: str) -> str:
    """Build `which` (operator or trainer) and load it into the node; its name. Cached layers make
    a rebuild without changes take seconds; the first trainer build takes several minutes."""
    run_checked(["bash", SCRIPT, which], timeout=3600)
    return names()[which]


def inspect(image: str, fmt: str) -> str:
    return run_checked([*BUILDAH, "inspect", "--type", "image", "--format", fmt, image]).stdout.strip()


def node_run(image: str, *cmd: str, env: dict[str, str] | None = None, mounts: dict[Path, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run cmd in `image` from the node's containerd as a pod would (the image's user, entrypoint
    replaced by cmd, host network); read-only bind mounts host path -> container path."""
    args = [*CTR, "run", "--rm", "--net-host"]
    for k, v in (env or {}).items():
        args += ["--env", f"{k}={v}"]
    for host, inside in (mounts or {}).items():
        args += ["--mount", f"type=bind,src={host},dst={inside},options=rbind:ro"]
    args += [image, f"kubetrain-test-{uuid.uuid4().hex[:8]}", *cmd]
    return run_checked(args, check=False, timeout=timeout)


class Container:
    """A working container of ``image``; `command` is how to run something in it (chroot isolation, host network)."""

    def __init__(self, image: str):
        self.image = image
        self.name = ""

    def __enter__(self) -> Container:
        self.name = run_checked([*BUILDAH, "from", "--pull=never", self.image]).stdout.strip()
        return self

    def __exit__(self, *_: object) -> None:
        subprocess.run([*BUILDAH, "rm", self.name], capture_output=True, check=False)

    def command(self, *cmd: str, user: str = "65532:65532", env: dict[str, str] | None = None,
                volumes: dict[Path, str] | None = None) -> list[str]:
        args = [*BUILDAH, "run", "--isolation", "chroot", "--network", "host", "--user", user]
        for k, v in (env or {}).items():
            args += ["--env", f"{k}={v}"]
        for host, inside in (volumes or {}).items():
            args += ["-v", f"{host}:{inside}:ro"]
        return [*args, self.name, "--", *cmd]
