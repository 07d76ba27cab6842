"""data.uri: token or text shards streamed from S3-compatible object storage through a per-rank cache.

The objects under the URI that match data.glob, in key order, are the shards, listed once at start. A shard of
n tokens holds ``(n - 1) // seqLen`` consecutive, non-overlapping windows of ``seqLen + 1`` tokens. Each epoch
shuffles the shards anew from (seed, epoch); data-parallel rank r of D takes shards ``perm[r::D]`` and its stream
is their windows in order, epoch after epoch. Step s trains on samples ``s*P .. s*P+P-1`` of each rank's stream
(P = microBatchSize × gradientAccumulationSteps). Where sample k lies follows from the listing's sizes alone, so
the windows of a step are a function of (seed, step, D, listing) and a resume continues at the exact sample.

A background thread keeps the shard being read and the next PREFETCH ones of this rank's stream in the cache
directory (each downloaded under a temporary name, then renamed: a file there is complete) and deletes those
the stream has passed; training waits only for a shard that has not arrived yet.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kubetrain.core import contract
from kubetrain.core.api import DataSpec, TrainingJobSpec
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data.s3 import file_system, list_under, store_error
from kubetrain.trainer.data.text import load_corpus, split_micro_batches

log = logging.getLogger("kubetrain.trainer")

FIELD = "data.uri"
PREFETCH = 2
"""Shards of the stream downloaded ahead of the one being read."""
DOWNLOAD_ATTEMPTS = 3
"""Per shard, before the rank fails (and the gang restarts) on an error a restart may cure."""
PARTIAL = ".part"

# --------------------------------------------------------------------------- pure: shards and the stream


@dataclass(frozen=True)
class Shard:
    """One object of the listing: its key (``bucket/prefix/name``), size in bytes and bytes per token."""

    key: str
    size: int
    itemsize: int

    @property
    def tokens(self) -> int:
        return self.size // self.itemsize

    def windows(self, seq_len: int) -> int:
        return max(0, (self.tokens - 1) // seq_len)

    @property
    def dtype(self) -> np.dtype[Any]:
        """Little-endian token ids for ``.bin``, UTF-8 bytes (the byte tokenizer's ids) otherwise."""
        return np.dtype(f"<u{self.itemsize}") if is_token_shard(self.key) else np.dtype(np.uint8)


def is_token_shard(key: str) -> bool:
    return key.endswith(".bin")


def relative_key(key: str, root: str) -> str | None:
    """``key`` below the URI's ``bucket/prefix`` (the object's own name where the URI names one object); None
    for a key outside it (``prefix2/...`` beside ``prefix``)."""
    if key == root:
        return key.rsplit("/", 1)[-1]
    return key[len(root) + 1:] if key.startswith(f"{root}/") else None


def select_shards(listing: Mapping[str, int], root: str, glob: str, token_dtype: str) -> list[Shard]:
    """The listing's (key -> size) objects whose name below ``root`` matches ``glob``, in key order."""
    itemsize = np.dtype(token_dtype).itemsize
    names = {key: relative_key(key, root) for key in listing}
    return [Shard(key, listing[key], itemsize if is_token_shard(key) else 1)
            for key in sorted(listing) if (name := names[key]) is not None and fnmatch(name, glob)]


def check_shards(shards: Sequence[Shard], data: DataSpec, seq_len: int, ranks: int) -> None:
    """Every problem of the listing a restart cannot cure, as a ConfigError naming the field to fix."""
    if not shards:
        raise ConfigError(FIELD, f"no objects match {data.glob!r} under {data.uri}")
    for shard in shards:
        if is_token_shard(shard.key) and shard.size % shard.itemsize:
            raise ConfigError(FIELD, f"{shard.key}: {shard.size} bytes is not a whole number of {data.token_dtype} "
                              f"token ids ({shard.itemsize} bytes each): check data.tokenDtype")
        if shard.windows(seq_len) < 1:
            raise ConfigError(FIELD, f"{shard.key}: {shard.tokens} tokens, not enough for one window of seqLen+1 = "
                              f"{seq_len + 1}: merge small shards")
    text = [s.key for s in shards if not is_token_shard(s.key)]
    if text and (data.tokenizer != "byte" or data.tokenizer_uri is not None):
        field = "data.tokenizerUri" if data.tokenizer_uri is not None else "data.tokenizer"
        raise ConfigError(field, f"text shards in data.uri ({text[0]}, ...) are read with the byte tokenizer only, "
                          "not with data.tokenizer or data.tokenizerUri: tokenize offline into .bin shards")
    if len(shards) < ranks:
        raise ConfigError(FIELD, f"{len(shards)} shard(s) match {data.glob!r} under {data.uri}, fewer than the "
                          f"{ranks} data-parallel ranks: split the data into at least {ranks} shards")


def epoch_order(shards: int, seed: int, epoch: int) -> list[int]:
    """Epoch ``epoch``'s permutation of the shard indices: ordered by a hash of (seed, epoch, index), so it stays
    the same across library versions and machines."""
    def rank(i: int) -> bytes:
        return hashlib.blake2b(f"{seed}:{epoch}:{i}".encode(), digest_size=8).digest()

    return sorted(range(shards), key=rank)


def rank_shards(shards: int, seed: int, epoch: int, ranks: int, rank: int) -> list[int]:
    """The shards data-parallel rank ``rank`` of ``ranks`` reads in epoch ``epoch``, in order."""
    return epoch_order(shards, seed, epoch)[rank::ranks]


@dataclass(frozen=True)
class Sample:
    """Where sample k of a rank's stream lies: the ``slot``-th shard of its stream (counted over all epochs),
    which is listing index ``shard``, at window ``window``."""

    slot: int
    shard: int
    window: int


class StreamIndex:
    """Locates samples of one rank's stream from the shards' window counts only; epochs are laid out lazily."""

    def __init__(self, windows: Sequence[int], seed: int, ranks: int, rank: int) -> None:
        if not 0 <= rank < ranks <= len(windows) or min(windows) < 1:
            raise ValueError("every rank needs a shard, every shard a window")
        self.windows, self.seed, self.ranks, self.rank = list(windows), seed, ranks, rank
        self.per_epoch = len(range(rank, len(windows), ranks))
        self._orders: list[list[int]] = []
        self._starts: list[list[int]] = []
        """Per epoch, the stream's sample index at which each of its shards begins."""
        self._ends = [0]
        """The stream's sample index at which each epoch begins (then the next, not yet laid out)."""

    def _lay_out_epoch(self) -> None:
        order = rank_shards(len(self.windows), self.seed, len(self._orders), self.ranks, self.rank)
        starts = list(itertools.accumulate((self.windows[i] for i in order), initial=self._ends[-1]))
        self._orders.append(order)
        self._starts.append(starts[:-1])
        self._ends.append(starts[-1])

    def locate(self, k: int) -> Sample:
        while self._ends[-1] <= k:
            self._lay_out_epoch()
        epoch = bisect.bisect_right(self._ends, k) - 1
        j = bisect.bisect_right(self._starts[epoch], k) - 1
        return Sample(epoch * self.per_epoch + j, self._orders[epoch][j], k - self._starts[epoch][j])

    def shard_at(self, slot: int) -> int:
        """The listing index of the ``slot``-th shard of the stream."""
        epoch, j = divmod(slot, self.per_epoch)
        while len(self._orders) <= epoch:
            self._lay_out_epoch()
        return self._orders[epoch][j]


def step_samples(step: int, per_step: int) -> range:
    """The stream samples of optimizer step ``step`` (its first is 0) on every rank."""
    return range(step * per_step, (step + 1) * per_step)


# --------------------------------------------------------------------------- I/O: listing, cache, prefetch


def cache_dir(output_dir: Path | None, rank: int, environ: Mapping[str, str] | None = None) -> Path:
    """This rank's shard cache: ``<KUBETRAIN_CACHE_DIR, else the output dir's cache>/data/rank-RRRRR``."""
    e = os.environ if environ is None else environ
    root = Path(e[contract.CACHE_DIR]) if e.get(contract.CACHE_DIR) else None
    if root is None and output_dir is not None:
        root = output_dir / "cache"
    if root is None:
        raise ConfigError(contract.CACHE_DIR, f"data.uri needs a cache directory: neither {contract.CACHE_DIR} "
                          f"nor {contract.OUTPUT_DIR} is set")
    return root / contract.DATA_CACHE / f"rank-{rank:05d}"


def list_objects(fs: Any, uri: str) -> dict[str, int]:
    """key -> size of every object under ``uri`` (one listing)."""
    found = list_under(fs, FIELD, uri)
    return {key: int(info["size"]) for key, info in found.items() if info.get("type", "file") == "file"}


def cached_name(index: int, shard: Shard) -> str:
    """The shard's file name in the cache: a leftover of another listing (other key or size) never matches."""
    digest = hashlib.sha1(f"{shard.key}:{shard.size}".encode()).hexdigest()[:16]
    return f"{index:06d}-{digest}{'.bin' if is_token_shard(shard.key) else '.txt'}"


class Prefetcher:
    """A background thread that keeps the wanted shards (the one being read, then the next PREFETCH of the
    stream) in ``directory`` and deletes every other file there. Its error surfaces in :meth:`path`."""

    def __init__(self, fs: Any, shards: Sequence[Shard], directory: Path, uri: str) -> None:
        self.fs, self.shards, self.directory, self.uri = fs, shards, directory, uri
        self._cond = threading.Condition()
        self._wanted: list[int] = []
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kubetrain-data-prefetch", daemon=True)
        directory.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def file(self, index: int) -> Path:
        return self.directory / cached_name(index, self.shards[index])

    def path(self, wanted: list[int]) -> Path:
        """The local file of ``wanted[0]`` once it is there (``wanted``: it and the shards to fetch next)."""
        with self._cond:
            if wanted != self._wanted:
                self._wanted = wanted
                self._cond.notify_all()
            self._cond.wait_for(lambda: self._error is not None or self._stopped or self.file(wanted[0]).exists())
            if self._error is not None:
                raise self._error
            if self._stopped:
                raise RuntimeError("data.uri: the prefetch thread was stopped")
        return self.file(wanted[0])

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        seen: list[int] = []
        while True:
            seen = self._next(seen)
            if not seen:
                return
            try:
                self._sync(seen)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which raises it
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return

    def _next(self, seen: list[int]) -> list[int]:
        """The wanted shards once they differ from ``seen``; [] once stopped."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or self._wanted != seen)
            return [] if self._stopped else self._wanted

    def _sync(self, wanted: list[int]) -> None:
        keep = {self.file(i).name for i in wanted}
        for entry in self.directory.iterdir():
            if entry.name not in keep:  # passed by the stream, a leftover, or a cut-off download
                entry.unlink(missing_ok=True)
        for index in dict.fromkeys(wanted):
            if self._stopped:
                return
            if not self.file(index).exists():
                self._download(self.shards[index], self.file(index))
                with self._cond:
                    self._cond.notify_all()

    def _download(self, shard: Shard, dest: Path) -> None:
        partial = dest.with_name(dest.name + PARTIAL)
        for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
            try:
                self.fs.get_file(shard.key, str(partial))
                got = partial.stat().st_size
                if got != shard.size:
                    raise OSError(f"{shard.key}: {got} bytes downloaded, {shard.size} listed (changed since?)")
                os.replace(partial, dest)
                return
            except Exception as exc:
                config = store_error(exc, FIELD, self.uri)
                if config is not None:
                    raise config from exc
                if attempt == DOWNLOAD_ATTEMPTS:
                    raise
                log.warning("data.uri: downloading %s failed (%s); retrying", shard.key, exc)
                time.sleep(attempt)


class ShardStream:
    """data.uri's batches for one data-parallel rank: ``micro_batches`` as data.Sampler's."""

    def __init__(self, shards: Sequence[Shard], spec: TrainingJobSpec, ranks: int, rank: int,
                 prefetcher: Prefetcher) -> None:
        self.shards, self.seq_len = list(shards), spec.model.seq_len
        self.index = StreamIndex([s.windows(self.seq_len) for s in shards], spec.seed, ranks, rank)
        self.prefetcher = prefetcher
        self.vocab: int | None = None
        """The model's vocabulary, once known: every batch's largest id is checked against it."""
        self._open: tuple[int, np.ndarray[Any, Any]] | None = None

    @classmethod
    def open(cls, spec: TrainingJobSpec, ranks: int, rank: int, directory: Path) -> ShardStream:
        """List and check the shards (config errors before the gang forms), then start the prefetch thread."""
        assert spec.data.uri is not None
        fs = file_system(spec.s3, FIELD)
        root = spec.data.uri.removeprefix("s3://").rstrip("/")
        shards = select_shards(list_objects(fs, spec.data.uri), root, spec.data.glob, spec.data.token_dtype)
        check_shards(shards, spec.data, spec.model.seq_len, ranks)
        return cls(shards, spec, ranks, rank, Prefetcher(fs, shards, directory, spec.data.uri))

    def close(self) -> None:
        self._open = None
        self.prefetcher.close()

    def window(self, sample: Sample) -> torch.Tensor:
        """The sample's seqLen+1 token ids (int64), read from its shard's cached file."""
        if self._open is None or self._open[0] != sample.slot:
            wanted = [self.index.shard_at(s) for s in range(sample.slot, sample.slot + PREFETCH + 1)]
            path = self.prefetcher.path(wanted)
            self._open = (sample.slot, np.memmap(path, dtype=self.shards[sample.shard].dtype, mode="r"))
        start = sample.window * self.seq_len
        return torch.from_numpy(self._open[1][start:start + self.seq_len + 1].astype(np.int64))

    def micro_batches(
        self, step: int, micro_batch: int, grad_accum: int, world_size: int, rank: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tokens, targets) int64 tensors of shape [micro_batch, seqLen], one pair per micro-batch."""
        if (world_size, rank) != (self.index.ranks, self.index.rank):
            raise ValueError(f"stream of rank {self.index.rank} of {self.index.ranks}, asked for {rank} of {world_size}")
        samples = [self.index.locate(k) for k in step_samples(step, micro_batch * grad_accum)]
        windows = torch.stack([self.window(s) for s in samples])
        self._check_vocab(windows, samples)
        return split_micro_batches(windows, micro_batch, grad_accum)

    def _check_vocab(self, windows: torch.Tensor, samples: list[Sample]) -> None:
        top = int(windows.max())
        if self.vocab is not None and top >= self.vocab:
            row = int((windows >= self.vocab).any(dim=1).nonzero()[0])
            raise ConfigError(FIELD, f"{self.shards[samples[row].shard].key} holds token id {top}, but the model's "
                              f"vocabulary holds {self.vocab} ids: set model.vocabSize (built-in model) or tokenize "
                              "with the model's own tokenizer")


def eval_text(spec: TrainingJobSpec) -> torch.Tensor | None:
    """With data.uri, the evaluation text is data.evalPath's (a rule makes evalEverySteps need it)."""
    if spec.eval_every_steps is None or spec.data.eval_path is None:
        return None
    held_out = spec.data.model_copy(update={"path": spec.data.eval_path})
    return load_corpus(held_out, spec.model.seq_len, field="data.evalPath")
