"""checkpoint.uri: the durable tier in S3-compatible object storage, through s3fs (fsspec's S3 file system).

The directory format is directory.py's, with the bucket in the place of the shared directory::

    <uri>/step-NNNNNNNN/   every rank's files (dcp/, rng/, engine.pt, ... as a shared directory holds them)
                           trainer.json, then COMMITTED, written by rank 0 last
    <uri>/best-eval.json

Each rank writes its part of a checkpoint into a staging directory of its own (``<checkpoint dir>/staging/
rank-R/step-N``; in a pod an emptyDir, no claim), so that every file there is its own and complete once its write
has finished, and then uploads that directory. The commit rule does not change: rank 0 writes ``COMMITTED``
only once every rank's upload has finished (a barrier for a synchronous save; for a background one the
all-reduce of background.py, whose "write finished" now means "written and uploaded"), and only after checking
that every rank's RNG file is in the bucket. A step without ``COMMITTED`` (an upload cut off) is never listed
as a checkpoint, and rank 0 deletes such steps when a generation starts (no writer of the earlier one is left)
and when a commit prunes. A resume downloads the newest committed step into one directory per worker.

Errors that a restart cannot cure (no such bucket, credentials refused, no endpoint) become a ConfigError
naming checkpoint.uri: the gang exits 2 and the job fails with that message instead of restarting.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kubetrain.core.api import S3Spec
from kubetrain.core.progress import COMMIT_MARKER, checkpoint_dirname
from kubetrain.trainer.checkpoint.directory import BEST_EVAL, TRAINER_STATE, TrainerState, commit_marker
from kubetrain.trainer.checkpoint.fence import FENCE_FILE, Fence, GenerationFence
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data.s3 import call, file_system, require_bucket, store_error

log = logging.getLogger("kubetrain.trainer")

FIELD = "checkpoint.uri"
_STEP_DIR = re.compile(r"^step-(\d+)$")
PROBE = ".kubetrain-write-check"
"""The object rank 0 writes and deletes at start: the credentials may write and delete under the prefix."""


# --------------------------------------------------------------------------- pure decisions


def parse_step(name: str) -> int | None:
    """The step of a ``step-NNNNNNNN`` directory name (a key's last segment), else None."""
    m = _STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def steps_to_delete(steps: dict[int, bool], keep: int, best_eval: int | None) -> list[int]:
    """Which step directories a commit removes: committed ones beyond the newest ``keep`` (never the best-eval
    one), and uncommitted ones (torn uploads) older than the newest committed. ``steps``: step -> committed."""
    done = sorted(s for s, ok in steps.items() if ok)
    doomed = [s for s in done[:-keep] if s != best_eval]
    if done:
        doomed += [s for s, ok in steps.items() if not ok and s < done[-1]]
    return sorted(doomed)


# --------------------------------------------------------------------------- local directories


def staging_dir(checkpoint_dir: Path, rank: int) -> Path:
    """This rank's own staging root: every file in it is this rank's."""
    return checkpoint_dir / "staging" / f"rank-{rank:05d}"


def restore_dir(checkpoint_dir: Path, node_rank: int) -> Path:
    """Where a worker's processes find the checkpoint they resume from (one download per worker)."""
    return checkpoint_dir / "restore" / f"worker-{node_rank:05d}"


def fresh_step_dir(root: Path, step: int) -> Path:
    """This rank's empty directory for ``step`` (a torn save of the same step from an earlier generation goes)."""
    path = root / checkpoint_dirname(step)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def drop_staged(root: Path, up_to: int) -> None:
    """Staged steps up to ``up_to`` are in the bucket, committed: their local copies go."""
    for entry in root.glob("step-*"):
        step = parse_step(entry.name)
        if step is not None and step <= up_to:
            shutil.rmtree(entry, ignore_errors=True)


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- the bucket


@dataclass
class Bucket:
    """checkpoint.uri as the trainer reads and writes it. Every method may raise a ConfigError naming the uri."""

    uri: str
    fs: Any

    @classmethod
    def open(cls, uri: str, s3: S3Spec | None) -> Bucket:
        return cls(uri.rstrip("/"), file_system(s3, FIELD))

    def step_uri(self, step: int) -> str:
        return f"{self.uri}/{checkpoint_dirname(step)}"

    def call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs); an error no restart cures becomes a ConfigError naming checkpoint.uri."""
        return call(FIELD, self.uri, what, fn, *args, **kwargs)

    def check(self) -> None:
        """Rank 0 at start: the bucket exists and these credentials may list, write and delete under the prefix.
        Any failure here is a ConfigError: the gang has not trained yet, a restart would fail the same way."""
        require_bucket(self.fs, FIELD, self.uri)
        probe = f"{self.uri}/{PROBE}"
        try:
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as exc:
            config = store_error(exc, FIELD, self.uri, first_contact=True)
            raise (config or ConfigError(FIELD, f"{self.uri}: {type(exc).__name__}: {exc}")) from exc

    def fence(self, mine: Fence | None) -> GenerationFence:
        """The generation fence as an object beside the step directories."""
        key = f"{self.uri}/{FENCE_FILE}"

        def read() -> str | None:
            try:
                body = self.fs.cat_file(key)
            except FileNotFoundError:
                return None
            except Exception:  # noqa: BLE001 - call() turns it into the error a restart cures or not
                body = self.call("download", self.fs.cat_file, key)
            return bytes(body).decode(errors="replace")

        return GenerationFence(mine, read, lambda text: self.call("upload", self.fs.pipe_file, key, text.encode()))

    def steps(self) -> dict[int, bool]:
        """Every step directory holding an object -> whether it is committed. From one listing of the objects
        (not of "directories": stores such as SeaweedFS keep listing a folder whose objects are all deleted)."""
        base = self.uri.split("://", 1)[1]
        found: dict[int, bool] = {}
        for key in self.call("listing", self.fs.find, base):
            head, _, rest = key[len(base) + 1:].partition("/")
            step = parse_step(head)
            if step is not None and rest:
                found[step] = found.get(step, False) or rest == COMMIT_MARKER
        return found

    def newest(self) -> tuple[int, str] | None:
        """The newest committed step and its uri."""
        done = [s for s, ok in self.steps().items() if ok]
        return (max(done), self.step_uri(max(done))) if done else None

    def resume_point(self) -> tuple[int, str] | None:
        """Rank 0 when a generation starts: access checked, torn steps removed, the newest committed step."""
        self.check()
        self.remove_torn()
        return self.newest()

    def remove_torn(self) -> None:
        """Rank 0 when a generation starts (no writer of an earlier one is left): steps never committed go."""
        for step, ok in self.steps().items():
            if not ok:
                log.info("removing %s: never committed (an upload cut off)", self.step_uri(step))
                self.call("delete", self.fs.rm, self.step_uri(step), recursive=True)

    def upload(self, path: Path, step: int) -> None:
        """Every file of this rank's staged directory ``path`` to the step's directory (relative paths kept)."""
        local = files_under(path)
        remote = [f"{self.step_uri(step)}/{p.relative_to(path).as_posix()}" for p in local]
        if local:
            self.call("upload", self.fs.put, [str(p) for p in local], remote)

    def upload_after(self, write: Future[Any], path: Path, step: int) -> Future[Any]:
        """A future that finishes once ``write`` (the background DCP write) has finished and ``path`` is
        uploaded. A daemon thread: a process that exits mid-upload leaves a torn step, never a hung exit."""
        done: Future[Any] = Future()

        def run() -> None:
            try:
                write.result()
                self.upload(path, step)
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=run, name=f"upload-step-{step}", daemon=True).start()
        return done

    def commit(self, path: Path, state: TrainerState, keep: int, world_size: int) -> str:
        """Rank 0, once every rank's upload finished: trainer.json, then COMMITTED, best-eval.json when this is
        the best evaluation's checkpoint, then pruning. The committed step's uri."""
        step_uri = self.step_uri(state.step)
        self.call("upload", self.fs.pipe_file, f"{step_uri}/{TRAINER_STATE}",
                  json.dumps(asdict(state), indent=1).encode())
        missing = self._missing_parts(step_uri, world_size)
        if missing:
            raise RuntimeError(f"{step_uri}: no RNG file of rank(s) {missing[:8]} after every rank uploaded; "
                               "not committed")
        self.call("commit", self.fs.pipe_file, f"{step_uri}/{COMMIT_MARKER}",
                  (json.dumps(commit_marker(state)) + "\n").encode())
        best = (state.best_eval or {}).get("step")
        if best == state.step:
            body = json.dumps({**(state.best_eval or {}), "path": checkpoint_dirname(state.step)}) + "\n"
            self.call("upload", self.fs.pipe_file, f"{self.uri}/{BEST_EVAL}", body.encode())
        self.prune(keep, best)
        return step_uri

    def _missing_parts(self, step_uri: str, world_size: int) -> list[int]:
        names = {p.rsplit("/", 1)[-1] for p in self.call("listing", self.fs.ls, f"{step_uri}/rng", detail=False)}
        return [r for r in range(world_size) if f"rank-{r:05d}.pt" not in names]

    def prune(self, keep: int, best_eval: int | None) -> None:
        for step in steps_to_delete(self.steps(), keep, best_eval):
            self.call("delete", self.fs.rm, self.step_uri(step), recursive=True)

    def download(self, step: int, root: Path) -> Path:
        """The committed ``step`` into ``root`` (emptied first: what an earlier restore left is not this step's)."""
        shutil.rmtree(root, ignore_errors=True)
        target = root / checkpoint_dirname(step)
        target.mkdir(parents=True)
        base = self.step_uri(step).split("://", 1)[1]  # s3fs lists keys without the scheme
        remote = [p for p in self.call("listing", self.fs.find, base) if p.startswith(base + "/")]
        local = [target / p[len(base) + 1:] for p in remote]
        for file in local:
            file.parent.mkdir(parents=True, exist_ok=True)
        self.call("download", self.fs.get, remote, [str(f) for f in local])
        return target
