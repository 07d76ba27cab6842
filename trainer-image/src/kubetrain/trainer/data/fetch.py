"""The fetch step: model.hfUri, data.tokenizerUri and a chat or instruction data.uri into the worker's cache before
training.

``python -m kubetrain.trainer.data.fetch`` reads the job's config (contract.CONFIG) and copies every object under each
URI of ``spec.fetched_uris()`` to ``$KUBETRAIN_CACHE_DIR/<model|tokenizer|samples>/``, keeping the keys' paths relative to
the URI. In a pod it is the init container ``fetch`` (its cache an emptyDir the trainer mounts too); a local run
runs it once before it starts the ranks. Each file is written under a temporary name and renamed; the marker
``.kubetrain-fetched.json`` (the URI and the listing's keys, sizes and ETags) is written last, so a restarted
container or pod whose cache survived downloads nothing while the objects are unchanged.

Worker 0 reports the bytes done of the total as ``Progress.fetch`` (the pod's progress annotation, or
progress.json in a local run): the job's ``status.fetch``. Exit codes as the trainer's: 2 for what no restart
cures (no such bucket, credentials refused, no objects, no config.json), with "configuration error: <field>: ..."
in the termination message; 1 for anything else (the gang restarts).

The trainer then reads the cache through :func:`resolved`: model.hfPath, data.tokenizer and data.path point into it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from kubetrain.core import contract
from kubetrain.core.api import Fetch, TrainingJobSpec
from kubetrain.trainer.config import ConfigError, config_error, load_spec
from kubetrain.trainer.data import s3

log = logging.getLogger("kubetrain.trainer.data.fetch")

MARKER = ".kubetrain-fetched.json"
"""In each fetched directory, written last: the URI and the listing it holds."""
TARGETS = {"model.hfUri": contract.MODEL_CACHE, "data.tokenizerUri": contract.TOKENIZER_CACHE,
           "data.uri": contract.SAMPLES_CACHE}
"""Each fetched field's directory under the cache."""
HF_CONFIG = "config.json"
LOG_INTERVAL_SECONDS = 5.0
"""At most one progress line (and progress record) this often while bytes arrive."""
TMP_SUFFIX = ".kubetrain-part"

Report = Callable[[Fetch, bool], None]
"""Where worker 0's fetch record goes: (record, force)."""


# --------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Listing:
    """The objects under one fetched URI: key relative to the URI -> (size, ETag)."""

    field: str
    uri: str
    objects: dict[str, tuple[int, str]]

    @property
    def total(self) -> int:
        return sum(size for size, _ in self.objects.values())

    def marker(self) -> dict[str, Any]:
        """The marker's content: what a cache holding exactly these objects says of itself."""
        return {"uri": self.uri, "objects": {k: {"size": s, "etag": e} for k, (s, e) in sorted(self.objects.items())}}


def relative_objects(field: str, uri: str, found: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[int, str]]:
    """s3fs's detailed listing (key without the scheme -> info) as relative key -> (size, ETag): objects under
    the URI only, "folder" placeholders left out; a key that would leave the cache directory is a ConfigError."""
    base = uri.split("://", 1)[1].rstrip("/") + "/"
    objects: dict[str, tuple[int, str]] = {}
    for key, info in found.items():
        if not key.startswith(base) or key.endswith("/") or info.get("type", "file") != "file":
            continue
        rel = key[len(base):]
        if any(part in ("", ".", "..") for part in rel.split("/")):
            raise ConfigError(field, f"{uri}: the object key {key!r} is not a relative file path")
        objects[rel] = (int(info.get("size") or 0), str(info.get("ETag") or info.get("etag") or ""))
    return objects


def check_listing(listing: Listing) -> None:
    """What no restart cures: nothing to fetch, or a model directory without its config."""
    if not listing.objects:
        raise ConfigError(listing.field, f"no objects under {listing.uri}")
    if listing.field == "model.hfUri" and HF_CONFIG not in listing.objects:
        raise ConfigError(listing.field, f"{listing.uri}: no {HF_CONFIG} among its {len(listing.objects)} object(s): "
                                         "not a Hugging Face model directory (what save_pretrained writes)")


def read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_fetched(directory: Path, listing: Listing) -> bool:
    """The cache directory holds exactly this listing (its marker says so)."""
    return read_marker(directory) == listing.marker()


def local_path(directory: Path, key: str) -> Path:
    return directory.joinpath(*PurePosixPath(key).parts)


def should_report(environ: Mapping[str, str]) -> bool:
    """Worker 0 only (its first rank, where a worker's processes have ranks): every pod fetches, one reports."""
    return environ.get(contract.NODE_RANK, "0") in ("", "0") and environ.get(contract.RANK, "0") in ("", "0")


def resolved(spec: TrainingJobSpec, cache_dir: Path | None) -> TrainingJobSpec:
    """The spec the trainer runs: model.hfUri, data.tokenizerUri and a fetched data.uri (chat or instruction)
    replaced by model.hfPath, data.tokenizer and data.path in the cache, once the fetch step has put them there
    (its markers say so), else a ConfigError."""
    uris = spec.fetched_uris()
    if not uris:
        return spec
    if cache_dir is None:
        raise ConfigError(contract.CACHE_DIR, f"not set: {', '.join(uris)} are read from the cache it names")
    for name, uri in uris.items():
        where = cache_dir / TARGETS[name]
        if (read_marker(where) or {}).get("uri") != uri:
            raise ConfigError(name, f"{uri} is not in the cache {where}: the fetch step did not run (`python -m "
                                    f"kubetrain.trainer.data.fetch`; in a pod the init container `{contract.FETCH_CONTAINER}`)")
    model, data = spec.model, spec.data
    if model.hf_uri is not None:
        model = model.model_copy(update={"hf_uri": None, "hf_path": str(cache_dir / contract.MODEL_CACHE)})
    if data.tokenizer_uri is not None:
        data = data.model_copy(update={"tokenizer_uri": None, "tokenizer": str(cache_dir / contract.TOKENIZER_CACHE)})
    if "data.uri" in uris:  # the JSONL files, read whole: data.glob picks them there as under any data.path
        data = data.model_copy(update={"uri": None, "path": str(cache_dir / contract.SAMPLES_CACHE)})
    return spec.model_copy(update={"model": model, "data": data})


# --------------------------------------------------------------------------- progress


@dataclass
class Meter:
    """Bytes in the cache over every fetched URI: a log line and a report at most every LOG_INTERVAL_SECONDS."""

    total: int
    report: Report | None
    done: int = 0
    """In the cache: downloaded, or found there already."""
    downloaded: int = 0
    current: tuple[str, str] = ("", "")
    """(field, uri) being fetched."""
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)

    def record(self, done: bool = False) -> Fetch:
        name, uri = self.current
        return Fetch(uri=uri, field=name, bytes=min(self.done, self.total), total_bytes=self.total, done=done)

    def advance(self, n: int) -> None:
        self.done += n
        self.downloaded += n
        now = time.monotonic()
        if now - self.last >= LOG_INTERVAL_SECONDS:
            self.last = now
            self.say()

    def say(self, force: bool = False) -> None:
        mb_s = self.downloaded / 1e6 / max(time.monotonic() - self.started, 1e-9)
        log.info("%s: %.1f MB of %.1f MB in the cache (%.0f%%), downloading at %.1f MB/s", self.current[0],
                 self.done / 1e6, self.total / 1e6, 100 * self.done / max(self.total, 1), mb_s)
        if self.report is not None:
            self.report(self.record(), force)

    def finish(self) -> None:
        log.info("the cache is ready: %.1f MB, %.1f MB of it downloaded in %.1fs", self.total / 1e6,
                 self.downloaded / 1e6, time.monotonic() - self.started)
        if self.report is not None:
            self.report(self.record(done=True), True)


# --------------------------------------------------------------------------- the store


def list_uri(fs: Any, name: str, uri: str) -> Listing:
    found = Listing(name, uri, relative_objects(name, uri, s3.list_under(fs, name, uri)))
    check_listing(found)
    return found


def download(fs: Any, listing: Listing, directory: Path, meter: Meter) -> None:
    """Every object of the listing into ``directory`` (emptied first), each under a temporary name, then renamed;
    the marker last."""
    from fsspec.callbacks import Callback  # noqa: PLC0415 - s3fs's own dependency

    class Counted(Callback):
        def relative_update(self, inc: int = 1) -> None:
            meter.advance(inc)

    shutil.rmtree(directory, ignore_errors=True)
    base = listing.uri.split("://", 1)[1].rstrip("/")
    for key in sorted(listing.objects):
        target = local_path(directory, key)
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f".{target.name}{TMP_SUFFIX}")
        s3.call(listing.field, listing.uri, "download", fs.get_file, f"{base}/{key}", str(part), callback=Counted())
        os.replace(part, target)
    from kubetrain.core.progress import atomic_write_text  # noqa: PLC0415

    atomic_write_text(directory / MARKER, json.dumps(listing.marker(), indent=1) + "\n")


def fetch_all(spec: TrainingJobSpec, cache_dir: Path, report: Report | None) -> None:
    """Every fetched URI of the job into the cache; what the markers say is there already is skipped."""

    if not spec.fetched_uris():
        log.info("the job sets no model.hfUri, data.tokenizerUri or chat/instruction data.uri: nothing to fetch")
        return
    stores = {name: s3.file_system(spec.s3, name) for name in spec.fetched_uris()}  # one client each
    listings = [list_uri(stores[name], name, uri) for name, uri in spec.fetched_uris().items()]
    meter = Meter(sum(x.total for x in listings), report)
    for listing in listings:
        meter.current = (listing.field, listing.uri)
        directory = cache_dir / TARGETS[listing.field]
        if is_fetched(directory, listing):
            log.info("%s: %s is in the cache already (%d object(s), %.1f MB): nothing to download",
                     listing.field, listing.uri, len(listing.objects), listing.total / 1e6)
            meter.done += listing.total
            continue
        log.info("%s: fetching %d object(s), %.1f MB, from %s into %s", listing.field, len(listing.objects),
                 listing.total / 1e6, listing.uri, directory)
        meter.say(force=True)
        download(stores[listing.field], listing, directory, meter)
    meter.finish()


# --------------------------------------------------------------------------- entrypoint


def progress_report(environ: Mapping[str, str]) -> Report | None:
    """Worker 0's reporter: the pod's progress annotation and progress.json, as the trainer's records. The
    record already in progress.json (a resumed run's) is kept, with the fetch added."""
    if not should_report(environ):
        return None
    from kubetrain.core.progress import read_progress  # noqa: PLC0415
    from kubetrain.trainer.observe.progress import make_progress, report_progress  # noqa: PLC0415

    out = environ.get(contract.OUTPUT_DIR)
    base = (read_progress(Path(out)) if out else None) or make_progress(0, environ=environ)

    def report(record: Fetch, force: bool) -> None:
        progress = base.model_copy(update={"fetch": record, "time": contract.format_time(datetime.now(UTC))})
        report_progress(progress=progress, force=force)

    return report


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s fetch %(message)s")
    for name in ("botocore", "aiobotocore"):  # not "Found credentials in ..." once per client
        logging.getLogger(name).setLevel(logging.WARNING)

    try:
        config, cache = os.environ.get(contract.CONFIG), os.environ.get(contract.CACHE_DIR)
        if not config:
            raise ConfigError(contract.CONFIG, "environment variable is not set (path of the trainer config JSON)")
        if not cache:
            raise ConfigError(contract.CACHE_DIR, "environment variable is not set (where the fetch step writes)")
        fetch_all(load_spec(Path(config)), Path(cache), progress_report(os.environ))
    except ConfigError as exc:
        return config_error(exc)
    except Exception:  # noqa: BLE001 - transient: exit 1, the backend restarts the gang
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
