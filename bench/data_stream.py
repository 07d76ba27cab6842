"""What streaming data.uri from object storage costs against data.path's tokens held in memory.

    .venv/bin/python bench/data_stream.py [--shards 8] [--shard-tokens 4194304] [--steps 5000] [--ranks 1]
        [--wait-ms 10] [--throttle-mbps 16] [--out bench/results/X.json]

``--shards`` uint16 ``.bin`` shards of ``--shard-tokens`` random token ids are uploaded to a fresh bucket of a
private S3Proxy server on loopback (tests/support/objectstore.py's ObjectStoreServer, its jar fetched by
`hack/build.sh s3proxy`). In this one process (no process group: the trainer's data pieces are called
directly, as tests/unit/test_data_stream.py does), data-parallel rank 0 of ``--ranks`` produces the
micro-batches of ``--steps`` optimizer steps (microBatchSize 8, seqLen 1024, gradientAccumulationSteps 1:
8 × 1024 tokens per step), each step one timed ``micro_batches`` call, from:

- ``memory``: data.Sampler over the same tokens concatenated in memory (int32, as the trainer holds the ids of a
  Hugging Face tokenizer): data.path's path once the corpus is loaded (the load is not timed);
- ``cold``: data.stream.ShardStream with an empty cache: the first batch waits for the listing and the first
  shard's download; the prefetch thread then keeps the next PREFETCH shards coming;
- ``again``: the same steps again, a new ShardStream (a restarted rank) over the same cache directory. The cache
  holds only the shard being read and the next PREFETCH ones, so the shards of the early steps are downloaded
  again; the client, the server and the page cache are warm;
- ``throttled`` (with ``--throttle-mbps``): ``cold`` with every shard download held to that rate on the client
  side (read in 1 MiB chunks, paced): a slow store or link.

Reported per mode: per-step mean / p50 / max milliseconds, tokens/s delivered (input tokens of the steps over
the sum of the step times), the first batch's latency (for the streams from before the listing), the
downloads (count, MB/s of each: bytes over the seconds of its get_file, timed in a wrapper around the store
client), and two counts of steps that waited for a shard (the first step left out: a stream's always waits):
"waits", calls longer than ``--wait-ms`` (a call that reads a cached shard takes well under a millisecond here;
the ``memory`` mode, which never waits, shows the threshold's noise floor), and "shard missing", steps that found
a shard they read absent from the cache when they began (asked before the timed call).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from support.objectstore import REGION, ObjectStore, ObjectStoreServer, s3proxy_jar  # bench/support: tests/support

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.data.s3 import file_system
from kubetrain.trainer.data.stream import (
    FIELD,
    Prefetcher,
    ShardStream,
    check_shards,
    list_objects,
    select_shards,
    step_samples,
)
from kubetrain.trainer.data.text import Sampler

MICRO_BATCH, SEQ_LEN, GRAD_ACCUM, SEED = 8, 1024, 1, 7
CHUNK = 1 << 20
MB = 1e6


class TimedStore:
    """The store client, with each get_file (the prefetcher's one call per shard) timed, optionally paced."""

    def __init__(self, fs: Any, bytes_per_second: float | None = None) -> None:
        self.fs, self.rate = fs, bytes_per_second
        self.downloads: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)

    def get_file(self, rpath: str, lpath: str) -> None:
        start = time.perf_counter()
        if self.rate is None:
            self.fs.get_file(rpath, lpath)
        else:
            self._paced_copy(rpath, lpath)
        seconds = time.perf_counter() - start
        with self._lock:
            self.downloads.append({"key": rpath, "bytes": os.path.getsize(lpath), "seconds": seconds})

    def _paced_copy(self, rpath: str, lpath: str) -> None:
        assert self.rate is not None
        start, done = time.perf_counter(), 0
        with self.fs.open(rpath, "rb", block_size=CHUNK) as src, open(lpath, "wb") as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)
                done += len(chunk)
                time.sleep(max(0.0, start + done / self.rate - time.perf_counter()))


def make_shards(count: int, tokens: int) -> list[np.ndarray]:
    rng = np.random.default_rng(SEED)
    return [rng.integers(0, 32000, size=tokens, dtype=np.uint16) for _ in range(count)]


def upload(store: ObjectStore, shards: list[np.ndarray]) -> None:
    fs = store.filesystem()
    for i, shard in enumerate(shards):
        fs.pipe(store.url("corpus", f"shard-{i:04d}.bin"), shard.astype("<u2").tobytes())


def job_spec(store: ObjectStore) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "seed": SEED, "model": {"seqLen": SEQ_LEN}, "microBatchSize": MICRO_BATCH,
        "gradientAccumulationSteps": GRAD_ACCUM,
        "data": {"uri": store.url("corpus"), "glob": "*.bin", "tokenDtype": "uint16"},
        "s3": {"endpoint": store.endpoint_url, "region": REGION}})


def open_stream(spec: TrainingJobSpec, ranks: int, cache: Path, store: TimedStore) -> ShardStream:
    """ShardStream.open's steps, with the timed store client in the place of its own."""
    assert spec.data.uri is not None
    root = spec.data.uri.removeprefix("s3://").rstrip("/")
    shards = select_shards(list_objects(store, spec.data.uri), root, spec.data.glob, spec.data.token_dtype)
    check_shards(shards, spec.data, spec.model.seq_len, ranks)
    return ShardStream(shards, spec, ranks, 0, Prefetcher(store, shards, cache, spec.data.uri))


def step_times(batches: Callable[[int], Any], steps: int,
               missing: Callable[[int], bool] = lambda _: False) -> tuple[list[float], int]:
    """Seconds of each step's micro_batches call, and how many steps after the first found a shard they read
    missing from the cache (asked before the call, outside the timing)."""
    times, missed = [], 0
    for step in range(steps):
        missed += step > 0 and missing(step)
        start = time.perf_counter()
        batches(step)
        times.append(time.perf_counter() - start)
    return times, missed


def shard_missing(stream: ShardStream, step: int) -> bool:
    """Whether a shard that ``step`` reads is not (yet) in the cache: the call will wait for its download."""
    shards = {stream.index.locate(k).shard for k in step_samples(step, MICRO_BATCH * GRAD_ACCUM)}
    return not all(stream.prefetcher.file(i).exists() for i in shards)


def summary(times: list[float], missed: int, first_batch: float, wait_s: float) -> dict[str, Any]:
    ms = [t * 1e3 for t in times]
    return {
        "steps": len(times), "shard_missing_after_first": missed,
        "step_ms_mean": statistics.mean(ms), "step_ms_p50": statistics.median(ms), "step_ms_max": max(ms),
        "step_ms_mean_after_first": statistics.mean(ms[1:]), "step_ms_max_after_first": max(ms[1:]),
        "tokens_per_second": len(times) * MICRO_BATCH * GRAD_ACCUM * SEQ_LEN / sum(times),
        "first_batch_seconds": first_batch,
        "waits_after_first": sum(t > wait_s for t in times[1:]),
        "wait_seconds_after_first": sum(t for t in times[1:] if t > wait_s),
    }


def download_summary(store: TimedStore) -> dict[str, Any]:
    done = list(store.downloads)
    if not done:
        return {"downloads": 0}
    rates = [d["bytes"] / d["seconds"] / MB for d in done]
    return {"downloads": len(done), "download_mb": sum(d["bytes"] for d in done) / MB,
            "download_mbps_each": [round(r, 1) for r in rates], "download_mbps_median": statistics.median(rates),
            "download_mbps_overall": sum(d["bytes"] for d in done) / sum(d["seconds"] for d in done) / MB}


def measure_memory(shards: list[np.ndarray], args: argparse.Namespace) -> dict[str, Any]:
    corpus = torch.from_numpy(np.concatenate(shards).astype(np.int32))
    sampler = Sampler(corpus, SEQ_LEN, SEED)
    times, missed = step_times(lambda s: sampler.micro_batches(s, MICRO_BATCH, GRAD_ACCUM, args.ranks, 0), args.steps)
    return summary(times, missed, times[0], args.wait_ms / 1e3)


def measure_stream(spec: TrainingJobSpec, cache: Path, args: argparse.Namespace,
                   rate: float | None = None) -> dict[str, Any]:
    """One stream's steps; the first batch's latency counts from before the listing ("open": the client, the
    listing and the prefetch thread's start; the first call then waits for the first shard)."""
    start = time.perf_counter()
    store = TimedStore(file_system(spec.s3, FIELD), rate)
    stream = open_stream(spec, args.ranks, cache, store)
    opened = time.perf_counter() - start
    try:
        times, missed = step_times(lambda s: stream.micro_batches(s, MICRO_BATCH, GRAD_ACCUM, args.ranks, 0),
                                   args.steps, lambda s: shard_missing(stream, s))
    finally:
        stream.close()
    return {**summary(times, missed, opened + times[0], args.wait_ms / 1e3), "open_seconds": opened, **download_summary(store)}


def run_modes(server: ObjectStoreServer, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    shards = make_shards(args.shards, args.shard_tokens)
    store = server.new_bucket()
    upload(store, shards)
    spec = job_spec(store)
    os.environ |= {"AWS_ACCESS_KEY_ID": store.access_key, "AWS_SECRET_ACCESS_KEY": store.secret_key}
    results = {"memory": measure_memory(shards, args)}
    report(results, "memory")
    results["cold"] = measure_stream(spec, tmp / "cache", args)
    report(results, "cold")
    results["again"] = measure_stream(spec, tmp / "cache", args)
    report(results, "again")
    if args.throttle_mbps:
        results["throttled"] = measure_stream(spec, tmp / "cache-throttled", args, args.throttle_mbps * MB)
        report(results, "throttled")
    return results


def report(results: dict[str, Any], mode: str) -> None:
    r = results[mode]
    line = (f"{mode}: step mean {r['step_ms_mean']:.3f} ms, p50 {r['step_ms_p50']:.3f} ms, max {r['step_ms_max']:.1f} ms "
            f"({r['step_ms_max_after_first']:.1f} after the first), "
            f"{r['tokens_per_second'] / 1e6:.2f} M tokens/s, first batch {r['first_batch_seconds'] * 1e3:.1f} ms, "
            f"waits {r['waits_after_first']} ({r['wait_seconds_after_first']:.2f} s), "
            f"shard missing at {r['shard_missing_after_first']} steps")
    if "open_seconds" in r:
        line += f", open {r['open_seconds'] * 1e3:.1f} ms"
    if r.get("downloads"):
        line += f", {r['downloads']} downloads at {r['download_mbps_median']:.0f} MB/s (median)"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-tokens", type=int, default=4 << 20)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--ranks", type=int, default=1, help="measure data-parallel rank 0 of this many")
    ap.add_argument("--wait-ms", type=float, default=10.0, help="a step's call longer than this waited for a shard")
    ap.add_argument("--throttle-mbps", type=float, default=16.0, help="MB/s of the throttled run; 0: none")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kt-data-stream-") as tmp:
        server = ObjectStoreServer(s3proxy_jar(), Path(tmp) / "s3").start()
        try:
            results = run_modes(server, args, Path(tmp))
        finally:
            server.stop()
    out = {"shards": args.shards, "shard_tokens": args.shard_tokens, "token_dtype": "uint16", "ranks": args.ranks,
           "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN, "grad_accum": GRAD_ACCUM, "wait_ms": args.wait_ms,
           "throttle_mbps": args.throttle_mbps, "load_average": [load_before, os.getloadavg()[0]], "modes": results}
    print(json.dumps(results, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
