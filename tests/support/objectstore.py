"""A private S3-compatible object store for tests: SeaweedFS's `weed server` (master, volume server,
filer and S3 gateway in one process) built by `hack/build.sh seaweedfs`, on free loopback ports,
with its data in a temporary directory.

The gateway is always given an identities file (one admin with the fixed keys below): without one,
SeaweedFS accepts ANY key pair, and a test of credentials would prove nothing.
The `object_store` fixture (tests/conftest.py) hands each test a fresh bucket on one server per session.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from .builds import shown
from .cluster import cache_dir
from .paths import HACK_DIR
from .ports import free_port
from .processes import stop_process
from .waiting import WaitTimeout, wait_for

if TYPE_CHECKING:
    import s3fs

ACCESS_KEY = "kubetrain-test-access-key"
SECRET_KEY = "kubetrain-test-secret-key"
REGION = "us-east-1"  # any name: SeaweedFS signs with the one the client sends
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 3.0
# A new master would hold the first volume allocation for 15 s (waiting for volume servers that a
# rebuilt master has not heard from yet); here there is one, in the same process, so don't wait.
# Each bucket grows 2 volumes at first, not 7: each test makes its own bucket.
MASTER_TOML = """[master.volume_growth]
copy_1 = 2
allocation_deferral = "0s"
"""


@dataclass(frozen=True)
class ObjectStore:
    """Where a test's bucket is and the keys that open it."""

    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts...>``: the form fsspec and torch's DCP take."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def filesystem(self, *, secret_key: str | None = None) -> s3fs.S3FileSystem:
        """An s3fs client for this store (with another secret: to see it refused)."""
        import s3fs  # noqa: PLC0415 - optional: without it every other test still collects

        return s3fs.S3FileSystem(key=self.access_key, secret=secret_key or self.secret_key,
                                 endpoint_url=self.endpoint_url, client_kwargs={"region_name": REGION},
                                 skip_instance_cache=True, use_listings_cache=False)

    def env(self) -> dict[str, str]:
        """The variables that point s3fs (FSSPEC_S3_*) and AWS SDKs (AWS_*) of a child process here."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_REGION": REGION,
                "FSSPEC_S3_ENDPOINT_URL": self.endpoint_url, "FSSPEC_S3_KEY": self.access_key,
                "FSSPEC_S3_SECRET": self.secret_key}


def weed_binary() -> Path:
    """Where `hack/build.sh seaweedfs` puts `weed` (hack/lib.sh's bin_path layout), found without Go."""
    gomod = (HACK_DIR / "seaweedfs" / "go.mod").read_text()
    match = re.search(r"^\s*(?:require\s+)?github\.com/seaweedfs/seaweedfs\s+(v\S+)", gomod, re.MULTILINE)
    if match is None:
        raise RuntimeError("github.com/seaweedfs/seaweedfs is not required in hack/seaweedfs/go.mod")
    return cache_dir() / "bin" / f"seaweedfs-{match.group(1)}" / "weed"


def build_weed() -> Path:
    """`hack/build.sh seaweedfs`: the binary. Cold: minutes, or less where hack/prebuild.sh is building it
    already (build.sh then waits for that); either way it prints a line at least every 30 s."""
    proc = subprocess.run(["bash", str(HACK_DIR / "build.sh"), "seaweedfs"], timeout=3600, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"hack/build.sh seaweedfs exited {proc.returncode}")
    return weed_binary()


def require_weed() -> Path:
    """The built `weed`, building it where Go is on PATH; else skip, or fail under CI=true (also without s3fs)."""
    binary = weed_binary()
    if importlib.util.find_spec("s3fs") is None:
        _skip_or_fail("s3fs is not installed (pip install s3fs)")
    if binary.is_file():
        return binary
    if shutil.which("go") is None:
        _skip_or_fail(f"no SeaweedFS: {binary} is not built and Go is not on PATH (hack/build.sh seaweedfs)")
    with shown(f"the object store needs SeaweedFS ({binary}): hack/build.sh seaweedfs"):
        return build_weed()


def _skip_or_fail(why: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the object-store tests: {why}", pytrace=False)
    pytest.skip(why)


def identities(access_key: str, secret_key: str) -> dict[str, Any]:
    """The gateway's s3.json: one identity allowed everything."""
    return {"identities": [{"name": "admin", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}


def server_args(workdir: Path, config: Path, base_port: int) -> list[str]:
    """`weed server` flags: every listener on 127.0.0.1 at base_port..base_port+7, nothing else opened."""
    ports = {name: base_port + i for i, name in enumerate(
        ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
         "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc"])}
    return ["server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={workdir / 'data'}",
            *(f"-{name}={port}" for name, port in ports.items()),
            "-filer", "-s3", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={workdir / 'filer.sock'}", f"-s3.localSocket={workdir / 's3.sock'}",
            # No reports to seaweedfs.com. Each bucket grows volumes of its own; with -volume.max=0 their count is
            # free disk / volume size, so on a busy CI disk a session's later buckets found none left. Volumes are
            # sparse files and a test writes megabytes: small ones, a fixed count, read-only only below 256 MiB free.
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64", "-volume.max=400",
            "-volume.minFreeSpace=256MiB",
            "-volume.preStopSeconds=0"]  # it waits that long for clients to move to other volume servers


class WeedServer:
    """One `weed server` process; ``start()`` returns once a first object has been written through S3."""

    def __init__(self, binary: Path, workdir: Path):
        self.binary, self.dir = binary, workdir
        base = free_port(8)
        self.endpoint_url = f"http://127.0.0.1:{base + 6}"
        self.config = workdir / "s3.json"
        self.args = server_args(workdir, self.config, base)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WeedServer:
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        self.config.write_text(json.dumps(identities(ACCESS_KEY, SECRET_KEY)))
        (self.dir / "master.toml").write_text(MASTER_TOML)  # read from the working directory
        with (self.dir / "weed.log").open("wb") as log:
            self.proc = subprocess.Popen([str(self.binary), *self.args], cwd=self.dir, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(self._healthy, START_TIMEOUT_S, interval=0.2, what=f"SeaweedFS S3 at {self.endpoint_url}",
                     ignore=(OSError,))
            # The gateway answers before it can write: the filer joins the master's lock ring seconds later.
            probe = self.new_bucket()
            fs = probe.filesystem()
            wait_for(lambda: fs.pipe(probe.url("ready"), b"") or True, START_TIMEOUT_S, interval=0.5,
                     what="a first object written", ignore=(OSError,))
        except WaitTimeout as exc:
            self.stop()
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"weed server exited {self.proc.returncode}:\n{self.log_tail()}")
        with urllib.request.urlopen(f"{self.endpoint_url}/healthz", timeout=2) as rsp:
            return bool(rsp.status == 200)

    def stop(self) -> None:
        # SIGTERM, then SIGKILL: on SIGTERM the filer waits 15 s to flush its own change log to the volume
        # server that already stopped; the objects are not in it, and the data directory is thrown away.
        stop_process(self.proc, grace=STOP_GRACE_S, group=True)

    def new_bucket(self) -> ObjectStore:
        """A fresh, empty bucket that takes writes (retried while the filer and volume servers are still joining,
        and while the bucket's first volume grows: a put before that is an InternalError)."""
        store = ObjectStore(self.endpoint_url, ACCESS_KEY, SECRET_KEY, f"t-{uuid.uuid4().hex[:16]}")
        fs = store.filesystem()
        wait_for(lambda: fs.mkdir(store.bucket) or True, START_TIMEOUT_S, interval=0.5,
                 what=f"bucket {store.bucket} created", ignore=(OSError,))
        probe = store.url(".kubetrain-probe")
        try:
            wait_for(lambda: fs.pipe(probe, b"") or True, START_TIMEOUT_S, interval=0.5,
                     what=f"a first object written to bucket {store.bucket}", ignore=(OSError,))
        except WaitTimeout as exc:
            free = shutil.disk_usage(self.dir).free / 2**30
            raise AssertionError(f"{exc} ({free:.1f} GiB free under {self.dir}: SeaweedFS marks its volumes "
                                 f"read-only below 256 MiB free)\n{self.log_tail()}") from None
        fs.rm(probe)
        return store

    def log_tail(self, lines: int = 30) -> str:
        log = self.dir / "weed.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def serve(workdir: Path) -> Iterator[WeedServer]:
    """A started server for the duration of the generator (the body of a fixture)."""
    server = WeedServer(require_weed(), workdir)
    try:
        yield server.start()
    finally:
        server.stop()
