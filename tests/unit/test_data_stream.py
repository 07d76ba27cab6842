"""data.uri's stream (kubetrain.trainer.data.stream): the shuffle, the assignment of shards to data-parallel
ranks, where a sample lies, the listing's checks, and reading windows through the prefetching cache (a local
fsspec file system in the place of the bucket)."""

from __future__ import annotations

from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from support.waiting import wait_for

from kubetrain.core.api import DataSpec, TrainingJobSpec
from kubetrain.trainer.config import ConfigError
from kubetrain.trainer.data.stream import (
    PREFETCH,
    Prefetcher,
    Shard,
    ShardStream,
    StreamIndex,
    cache_dir,
    check_shards,
    epoch_order,
    rank_shards,
    select_shards,
    step_samples,
)

WINDOWS = [3, 1, 4, 2, 5, 1, 2]
"""Window counts of a listing of 7 shards."""


def brute_force(windows: list[int], seed: int, ranks: int, rank: int, epochs: int) -> list[tuple[int, int]]:
    """(shard, window) of every sample of a rank's stream over ``epochs`` epochs, by concatenation."""
    return [(i, w) for e in range(epochs) for i in rank_shards(len(windows), seed, e, ranks, rank)
            for w in range(windows[i])]


@pytest.mark.parametrize(("ranks", "rank"), [(1, 0), (2, 0), (2, 1), (3, 2), (7, 6)])
def test_a_sample_lies_where_the_concatenated_stream_has_it_across_shards_and_epochs(ranks: int, rank: int) -> None:
    expected = brute_force(WINDOWS, seed=11, ranks=ranks, rank=rank, epochs=4)
    index = StreamIndex(WINDOWS, seed=11, ranks=ranks, rank=rank)
    located = [index.locate(k) for k in range(len(expected))]
    assert [(s.shard, s.window) for s in located] == expected
    assert all(index.shard_at(s.slot) == s.shard for s in located)
    slots = [s.slot for s in located]
    assert slots == sorted(slots) and slots[-1] == 4 * index.per_epoch - 1


def test_the_same_step_gives_the_same_samples_however_the_index_was_reached() -> None:
    step, per_step = 9, 4
    fresh = StreamIndex(WINDOWS, seed=3, ranks=2, rank=1)
    walked = StreamIndex(WINDOWS, seed=3, ranks=2, rank=1)
    for k in range(step * per_step):  # a run that trained the steps before; `fresh` resumes at `step`
        walked.locate(k)
    assert [fresh.locate(k) for k in step_samples(step, per_step)] == \
        [walked.locate(k) for k in step_samples(step, per_step)]
    other_seed = StreamIndex(WINDOWS, seed=4, ranks=2, rank=1)
    assert [other_seed.locate(k) for k in range(40)] != [fresh.locate(k) for k in range(40)]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_within_an_epoch_the_ranks_split_the_shards_without_sharing_one(ranks: int) -> None:
    for shards in range(ranks, 10):
        for epoch in range(3):
            taken = [rank_shards(shards, 5, epoch, ranks, r) for r in range(ranks)]
            flat = [i for part in taken for i in part]
            assert sorted(flat) == list(range(shards))
            assert max(map(len, taken)) - min(map(len, taken)) <= 1


def test_every_epoch_shuffles_the_shards_anew() -> None:
    orders = {tuple(epoch_order(8, 1, e)) for e in range(4)}
    assert len(orders) == 4
    assert epoch_order(8, 1, 2) == epoch_order(8, 1, 2)


def test_the_listing_keeps_matching_objects_in_key_order_with_their_token_sizes() -> None:
    listing = {"b/p/s-2.bin": 400, "b/p/s-1.bin": 200, "b/p/notes.md": 9, "b/p/s-0.txt": 90, "b/px/s-9.bin": 8}
    shards = select_shards(listing, "b/p", "s-*", "uint32")
    assert shards == [Shard("b/p/s-0.txt", 90, 1), Shard("b/p/s-1.bin", 200, 4), Shard("b/p/s-2.bin", 400, 4)]
    assert [s.tokens for s in shards] == [90, 50, 100]
    assert [s.windows(16) for s in shards] == [5, 3, 6]
    assert select_shards({"b/p/x.bin": 4}, "b/p/x.bin", "*.bin", "uint16") == [Shard("b/p/x.bin", 4, 2)]
    assert select_shards({"b/px/s-9.bin": 8, "b/p/d/s.bin": 8}, "b/p", "*.bin", "uint16") == [Shard("b/p/d/s.bin", 8, 2)]


DATA = DataSpec(uri="s3://bkt/p", glob="*.bin")


@pytest.mark.parametrize(("shards", "data", "ranks", "field", "words"), [
    ([], DATA, 1, "data.uri", "no objects match '*.bin' under s3://bkt/p"),
    ([Shard("b/p/a.bin", 101, 2)], DATA, 1, "data.uri", "101 bytes is not a whole number of uint16"),
    ([Shard("b/p/a.bin", 64, 2)], DATA, 1, "data.uri", "32 tokens, not enough for one window of seqLen+1 = 33"),
    ([Shard("b/p/a.bin", 400, 2)] * 2, DATA, 3, "data.uri",
     "2 shard(s) match '*.bin' under s3://bkt/p, fewer than the 3 data-parallel ranks: split the data into at least 3"),
    ([Shard("b/p/a.txt", 400, 1)], DATA.model_copy(update={"tokenizer": "/tok"}), 1, "data.tokenizer",
     "tokenize offline into .bin shards"),
    ([Shard("b/p/a.txt", 400, 1)], DATA.model_copy(update={"tokenizer_uri": "s3://bkt/tok"}), 1, "data.tokenizerUri",
     "tokenize offline into .bin shards"),
])
def test_a_listing_that_cannot_train_is_a_config_error_naming_the_field(
    shards: list[Shard], data: DataSpec, ranks: int, field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check_shards(shards, data, 32, ranks)
    assert err.value.field == field and words in err.value.message


def test_token_shards_with_another_tokenizer_and_enough_shards_pass() -> None:
    check_shards([Shard("b/p/a.bin", 400, 2)] * 2, DATA.model_copy(update={"tokenizer": "/tok"}), 32, 2)


def test_the_cache_is_the_cache_dirs_else_the_output_dirs(tmp_path: Path) -> None:
    assert cache_dir(tmp_path, 3, {"KUBETRAIN_CACHE_DIR": "/cache"}) == Path("/cache/data/rank-00003")
    assert cache_dir(tmp_path, 0, {}) == tmp_path / "cache" / "data" / "rank-00000"
    with pytest.raises(ConfigError, match="KUBETRAIN_CACHE_DIR"):
        cache_dir(None, 0, {})


# --------------------------------------------------------------------------- reading through the cache

SEQ = 8


def write_shards(root: Path) -> list[np.ndarray]:
    """Four uint16 token shards (ids up to 299) and one text shard, each a different length."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 300, size=n, dtype=np.uint16) for n in (41, 17, 60, 33)]
    for i, a in enumerate(arrays):
        a.astype("<u2").tofile(root / f"s-{i}.bin")
    text = b"the quick brown fox jumps over the lazy dog"
    (root / "s-4.txt").write_bytes(text)
    return [*arrays, np.frombuffer(text, dtype=np.uint8)]


def open_stream(tmp_path: Path, ranks: int, rank: int) -> tuple[ShardStream, list[np.ndarray]]:
    bucket = tmp_path / "bucket"
    bucket.mkdir(exist_ok=True)
    arrays = write_shards(bucket)
    fs = fsspec.filesystem("file")
    listing = {str(p): p.stat().st_size for p in bucket.iterdir()}
    shards = select_shards(listing, str(bucket), "s-*", "uint16")
    spec = TrainingJobSpec.model_validate({"seed": 5, "model": {"seqLen": SEQ}})
    directory = tmp_path / f"cache-{rank}"
    return ShardStream(shards, spec, ranks, rank, Prefetcher(fs, shards, directory, str(bucket))), arrays


def test_a_steps_batches_are_the_windows_of_its_samples_read_through_the_cache(tmp_path: Path) -> None:
    stream, arrays = open_stream(tmp_path, ranks=2, rank=1)
    try:
        mbs, ga = 2, 3
        per_step = mbs * ga
        windows = [a.size and (a.size - 1) // SEQ for a in arrays]
        expected = brute_force(windows, 5, 2, 1, epochs=6)
        for step in (0, 4, 2):  # forward, then back (a resume at an earlier step)
            got = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in stream.micro_batches(step, mbs, ga, 2, 1)])
            want = [arrays[i][w * SEQ : w * SEQ + SEQ + 1].astype(np.int64) for i, w in
                    expected[step * per_step : (step + 1) * per_step]]
            assert torch.equal(got, torch.from_numpy(np.stack(want)))
        directory = stream.prefetcher.directory
        # The prefetcher may still be downloading the next shard (a .part): every download ends renamed.
        wait_for(lambda: len(list(directory.iterdir())) <= PREFETCH + 1 and not list(directory.glob("*.part")), 10,
                 what="passed shards deleted, no download left partial")
    finally:
        stream.close()


def test_a_token_id_beyond_the_models_vocabulary_is_a_config_error_naming_it(tmp_path: Path) -> None:
    stream, arrays = open_stream(tmp_path, ranks=1, rank=0)
    try:
        stream.vocab = 200
        with pytest.raises(ConfigError) as err:
            stream.micro_batches(0, 4, 4, 1, 0)
        top = max(int(a.max()) for a in arrays[:4])
        assert err.value.field == "data.uri" and f"token id {top}" in err.value.message
        assert "vocabulary holds 200 ids" in err.value.message
        stream.vocab = 300
        assert len(stream.micro_batches(0, 4, 4, 1, 0)) == 4
    finally:
        stream.close()
