"""hack/images.sh (`make images`) without building anything: the names it builds are the ones the
chart and the operator use by default, and a machine that cannot build says what it lacks.

The builds themselves are tested by tests/integration/test_helm_image.py wherever the real node runs.
"""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
import yaml

from kubetrain.operator.jobs.builders import WorkerSettings

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "images.sh"


def _script(*args: str, user: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(user or []), "bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_images_are_the_chart_and_operator_defaults() -> None:
    values = yaml.safe_load((REPO / "charts/kubetrain/values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts/kubetrain/Chart.yaml").read_text())
    proc = _script("names")
    assert proc.returncode == 0, proc.stderr
    names = dict(line.split() for line in proc.stdout.splitlines())
    operator = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    assert names == {"operator": operator, "trainer": values["trainerImage"]}
    assert names["trainer"] == WorkerSettings().trainer_image
    # Fully qualified, as CRI looks images up (it would turn `kubetrain/x` into docker.io/kubetrain/x).
    assert all("." in n.split("/")[0] for n in names.values())


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to drop to another uid")
def test_non_root_is_told_what_is_missing() -> None:
    # The checkout may sit in a directory only root can read (a mktemp clone): the other user runs a
    # copy of the scripts and the pins they read, in a world-readable directory.
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        hack = Path(tmp) / "hack"
        hack.mkdir(mode=0o755)
        for name in ("hack/images.sh", "hack/lib.sh", "requirements-dev.txt"):
            shutil.copy(REPO / name, Path(tmp) / name)
            (Path(tmp) / name).chmod(0o755)
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash",
                               str(hack / "images.sh"), "check"], capture_output=True, text=True, timeout=60,
                              check=False)
    assert proc.returncode == 1
    assert "building the images needs root" in proc.stderr
    assert "uid 65534" in proc.stderr


def test_unknown_image_is_refused() -> None:
    proc = _script("operater")
    assert proc.returncode == 1
    assert "unknown image 'operater'" in proc.stderr


def test_the_fingerprint_follows_every_copied_file_and_nothing_else(tmp_path: Path) -> None:
    """A build is skipped while its fingerprint stays: it must change with a copied file's content, mode or
    presence, the Dockerfile and the build arguments, and not with caches the context leaves out."""
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "data.txt").write_text("text\n")
    (tmp_path / "more.txt").write_text("more\n")
    (tmp_path / "other").mkdir()
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM base AS build\nCOPY src /src\nCOPY data.txt \\\n  more.txt /files/\n"
                          "FROM base\nCOPY --from=build /src /src\n")

    def fingerprint(*extra: str) -> str:
        proc = _script("fingerprint", str(dockerfile), str(tmp_path), *extra)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    first = fingerprint("arg=1")
    assert len(first) == 64 and fingerprint("arg=1") == first
    assert fingerprint("arg=2") != first
    (tmp_path / "src" / "pkg" / "__pycache__").mkdir()
    (tmp_path / "src" / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"cache")
    (tmp_path / "other" / "b.py").write_text("not copied\n")
    assert fingerprint("arg=1") == first
    changes = [lambda: (tmp_path / "src" / "pkg" / "a.py").write_text("x = 2\n"),
               lambda: (tmp_path / "src" / "pkg" / "a.py").chmod(0o755),
               lambda: (tmp_path / "src" / "pkg" / "new.py").write_text(""),
               lambda: (tmp_path / "data.txt").write_text("other text\n"),
               lambda: (tmp_path / "more.txt").write_text("other\n"),  # named on a continued line
               lambda: dockerfile.write_text(dockerfile.read_text() + "ENV X=1\n")]
    seen = {first}
    for change in changes:
        change()
        now = fingerprint("arg=1")
        assert now not in seen
        seen.add(now)


class _Registry(http.server.BaseHTTPRequestHandler):
    """A registry's manifest HEAD: one known tag, 404 for the rest (an image never pushed)."""

    def do_HEAD(self) -> None:
        known = self.path == "/v2/kubetrain-trainer/manifests/0.1.0"
        self.send_response(200 if known else 404)
        if known:
            self.send_header("Docker-Content-Digest", "sha256:" + "ab" * 32)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


def test_a_tag_the_registry_does_not_serve_is_nothing_not_a_failure() -> None:
    """A first push asks the registry for a tag it has never had (404): the script goes on to push it."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registry = f"127.0.0.1:{server.server_address[1]}"
    try:
        known = _script("served", registry, "kubetrain-trainer", "0.1.0")
        unknown = _script("served", registry, "kubetrain-operator", "0.1.0")
    finally:
        server.shutdown()
    assert (known.returncode, known.stdout) == (0, "sha256:" + "ab" * 32 + "\n"), known.stderr
    assert (unknown.returncode, unknown.stdout) == (0, ""), unknown.stderr
