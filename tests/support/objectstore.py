"""A private S3-compatible object store for tests: S3Proxy (a Java S3 server over a directory, its jar fetched by
`hack/build.sh s3proxy`) on a free loopback port, with its data in a temporary directory.

The server accepts one key pair (the fixed keys below) and checks every request's signature (AWS v2 and v4).
The `object_store` fixture (tests/conftest.py) hands each test a fresh bucket on one server per session.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

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
REGION = "us-east-1"  # any name: the server checks signatures with the one the client sends
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 3.0
PIN = HACK_DIR / "s3proxy" / "pin"


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


def pinned(key: str) -> str:
    """A value of hack/s3proxy/pin (version, sha256, java_opts)."""
    for line in PIN.read_text().splitlines():
        if line.startswith(f"{key}="):
            return line.split("=", 1)[1]
    raise RuntimeError(f"{PIN} has no {key}=")


def s3proxy_jar() -> Path:
    """Where `hack/build.sh s3proxy` puts the jar (hack/lib.sh's bin_path layout)."""
    return cache_dir() / "bin" / f"s3proxy-{pinned('version')}" / "s3proxy.jar"


def fetch_s3proxy() -> Path:
    """`hack/build.sh s3proxy`: the jar, fetched from Maven Central and checked (seconds), or waited for where
    hack/prebuild.sh is fetching it."""
    proc = subprocess.run(["bash", str(HACK_DIR / "build.sh"), "s3proxy"], timeout=900, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"hack/build.sh s3proxy exited {proc.returncode}")
    return s3proxy_jar()


def require_s3proxy() -> Path:
    """The fetched jar, fetching it where curl is on PATH; else skip, or fail under CI=true (also without s3fs or
    Java)."""
    jar = s3proxy_jar()
    if importlib.util.find_spec("s3fs") is None:
        _skip_or_fail("s3fs is not installed (pip install s3fs)")
    if shutil.which("java") is None:
        _skip_or_fail("no Java on PATH: S3Proxy needs Java >= 17 (Debian: apt-get install openjdk-17-jre-headless)")
    if jar.is_file():
        return jar
    if shutil.which("curl") is None:
        _skip_or_fail(f"no S3Proxy: {jar} is not fetched and curl is not on PATH (hack/build.sh s3proxy)")
    with shown(f"the object store needs S3Proxy ({jar}): hack/build.sh s3proxy"):
        return fetch_s3proxy()


def _skip_or_fail(why: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the object-store tests: {why}", pytrace=False)
    pytest.skip(why)


def properties(data: Path, port: int) -> str:
    """S3Proxy's configuration: the fixed keys, objects as files under `data`, listening on loopback only."""
    return "\n".join([f"s3proxy.endpoint=http://127.0.0.1:{port}", "s3proxy.authorization=aws-v2-or-v4",
                      f"s3proxy.identity={ACCESS_KEY}", f"s3proxy.credential={SECRET_KEY}",
                      "jclouds.provider=filesystem-nio2", f"jclouds.filesystem.basedir={data}", ""])


def create_bucket(fs: s3fs.S3FileSystem, bucket: str) -> None:
    """S3's CreateBucket itself, not s3fs's mkdir: that first asks GetBucketLocation, which S3Proxy answers for a
    bucket that does not exist (and mkdir then refuses, the bucket "exists")."""
    fs.call_s3("create_bucket", Bucket=bucket)


class ObjectStoreServer:
    """One S3Proxy process; ``start()`` returns once it answers."""

    def __init__(self, jar: Path, workdir: Path):
        self.jar, self.dir = jar, workdir
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "s3proxy.conf"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ObjectStoreServer:
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        self.config.write_text(properties(self.dir / "data", self.port))
        with (self.dir / "s3proxy.log").open("wb") as log:
            self.proc = subprocess.Popen(["java", *pinned("java_opts").split(), "-jar", str(self.jar),
                                          "--properties", str(self.config)],
                                         cwd=self.dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(self._healthy, START_TIMEOUT_S, interval=0.2, what=f"S3Proxy at {self.endpoint_url}",
                     ignore=(OSError,))
        except WaitTimeout as exc:
            self.stop()
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"S3Proxy exited {self.proc.returncode}:\n{self.log_tail()}")
        with urllib.request.urlopen(f"{self.endpoint_url}/healthz", timeout=2) as rsp:
            return bool(rsp.status == 200)

    def stop(self) -> None:
        stop_process(self.proc, grace=STOP_GRACE_S, group=True)

    def new_bucket(self) -> ObjectStore:
        """A fresh, empty bucket."""
        store = ObjectStore(self.endpoint_url, ACCESS_KEY, SECRET_KEY, f"t-{uuid.uuid4().hex[:16]}")
        create_bucket(store.filesystem(), store.bucket)
        return store

    def log_tail(self, lines: int = 30) -> str:
        log = self.dir / "s3proxy.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def serve(workdir: Path) -> Iterator[ObjectStoreServer]:
    """A started server for the duration of the generator (the body of a fixture)."""
    server = ObjectStoreServer(require_s3proxy(), workdir)
    try:
        yield server.start()
    finally:
        server.stop()
