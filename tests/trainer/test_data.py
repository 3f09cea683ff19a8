"""Token shards as llm.c writes them: validation shards kept out of training, uint32 (LLaMA-3)
shards read as uint32, headerless files refused; the input pipeline (block reads, prefetch)
yields exactly what a per-sample read would, with few requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.data import DataLoader, ShardSource, SyntheticSource, build_source, build_val_source
from trainer.errors import ConfigError
from trainer.shards import encode


def _llmc_v3(tokens: np.ndarray) -> bytes:
    """A shard as llm.c's LLaMA-3 scripts write it: magic 20240801, version 7, uint32 tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240801, 7, tokens.size)
    return header.tobytes() + tokens.astype("<u4").tobytes()


def test_folder_never_trains_on_the_validation_shard(tmp_path):
    train = (np.arange(3000) * 7) % 200
    val = np.full(1000, 199)  # a token the test can spot
    (tmp_path / "fineweb_train_000001.bin").write_bytes(encode(train, 256))
    (tmp_path / "fineweb_val_000000.bin").write_bytes(encode(val, 256))  # sorts first, as in llm.c
    src = build_source(str(tmp_path), seq_len=64, vocab_size=256, seed=0)
    assert [f.rsplit("/", 1)[-1] for f in src.files] == ["fineweb_train_000001.bin"]
    assert src.total == 3000
    assert np.array_equal(src.sample(0), train[:65])
    vsrc = build_val_source(str(tmp_path), str(tmp_path / "fineweb_val_000000.bin"), seq_len=64, vocab_size=256, seed=0)
    # without trainer.val_data: the validation-named shards beside trainer.data
    assert build_val_source(str(tmp_path), None, seq_len=64, vocab_size=256, seed=0).files == vsrc.files
    assert vsrc.total == 1000 and set(vsrc.sample(3).tolist()) == {199}
    # Same rule for a glob; a folder of validation shards only is an error, not a silent val run.
    assert build_source(str(tmp_path / "*.bin"), seq_len=64, vocab_size=256, seed=0).total == 3000
    (tmp_path / "valonly").mkdir()
    (tmp_path / "valonly" / "val_000000.bin").write_bytes(encode(val, 256))
    with pytest.raises(ConfigError, match="only validation shards"):
        build_source(str(tmp_path / "valonly"), seq_len=64, vocab_size=256, seed=0)
    # Held-out synthetic validation differs from the training stream.
    assert not np.array_equal(build_val_source("synthetic", "synthetic", 16, 256, 0).sample(0), SyntheticSource(256, 16, 0).sample(0))


def test_llama3_uint32_shard_is_read_as_uint32(tmp_path):
    tokens = (np.arange(2000, dtype=np.int64) * 7919) % 128_256  # ids above 65535 included
    (tmp_path / "edu_fineweb_train_000001.bin").write_bytes(_llmc_v3(tokens))
    src = build_source(str(tmp_path), seq_len=100, vocab_size=128_256, seed=0)
    assert src.total == 2000
    for i in (0, 5, 19):
        assert np.array_equal(src.sample(i), np.array([tokens[(i * 100 + j) % 2000] for j in range(101)]))
    assert int(src.sample(3).max()) > 65535


def test_headerless_bin_is_refused_naming_the_file(tmp_path):
    (tmp_path / "raw.bin").write_bytes(np.arange(5000, dtype=np.uint16).tobytes())
    with pytest.raises(ConfigError, match=r"trainer.data: .*raw.bin.*not an llm.c token shard"):
        build_source(str(tmp_path), seq_len=16, vocab_size=65536, seed=0)


def test_block_reads_and_prefetch_match_per_sample_reads(tmp_path, monkeypatch, s3_server):
    """Remote shards (moto S3): micro-batches equal the per-sample windows, from a handful of
    ranged GETs (one per aligned block), not one request per sample."""
    import fsspec

    import trainer.data as data

    monkeypatch.setattr(data, "READ_BLOCK_BYTES", 4096)  # several blocks in a small shard
    stream = (np.arange(20_000) * 13) % 50_000
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("shards-bucket")
    fs.pipe("shards-bucket/d/train_000000.bin", encode(stream[:12_000], 50_000))
    fs.pipe("shards-bucket/d/train_000001.bin", encode(stream[12_000:], 50_000))
    src = build_source("s3://shards-bucket/d", seq_len=64, vocab_size=50_000, seed=0)
    assert isinstance(src, ShardSource) and src.total == 20_000
    dev = torch.device("cpu")
    steps = 20_000 // (8 * 64) + 3  # wraps around the stream
    got = []
    for r in (0, 1):
        ld = DataLoader(src, global_batch=8, micro_batch=2, dp_rank=r, dp=2, device=dev)
        for s in range(steps):
            got += [(s, r, x.clone(), y.clone()) for x, y in ld.batches(s)]
        ld.close()
    for s, r, x, y in got:
        assert x.shape == (2, 64) and torch.equal(x[:, 1:], y[:, :-1])
    first = [(s, r) for s, r, *_ in got]
    assert first.count((0, 0)) == 2  # accumulation 2
    want = torch.from_numpy(np.stack([src.sample(i) for i in range(8)]))
    step0 = torch.cat([x for s, r, x, _ in got if s == 0])
    assert sorted(map(tuple, step0.tolist())) == sorted(map(tuple, want[:, :-1].tolist()))
    n_blocks = -(-12_000 * 2 // 4096) + -(-8_000 * 2 // 4096)
    assert src.requests <= 4 * n_blocks  # per-sample reads would be 2 × 8 × steps ≈ 700


def test_prefetch_restarts_on_resume_and_raises_source_errors():
    class Boom(SyntheticSource):
        def samples(self, first, count):
            if first >= 40:
                raise ConfigError("trainer.data: token id 999 ≥ vocab_size 256")
            return super().samples(first, count)

    ld = DataLoader(Boom(256, 8, 0), global_batch=4, micro_batch=2, dp_rank=0, dp=1, device=torch.device("cpu"))
    a = [x.clone() for x, _ in ld.batches(3)]
    b = [x.clone() for x, _ in ld.batches(1)]  # out of order (a resume): restarts there
    ref = DataLoader(Boom(256, 8, 0), global_batch=4, micro_batch=2, dp_rank=0, dp=1, device=torch.device("cpu"),
                     prefetch=False)
    assert all(torch.equal(p, q) for p, q in zip(a, [x for x, _ in ref.batches(3)]))
    assert all(torch.equal(p, q) for p, q in zip(b, [x for x, _ in ref.batches(1)]))
    with pytest.raises(ConfigError, match="vocab_size"):
        for s in range(2, 20):
            list(ld.batches(s))
    ld.close()


def test_block_cache_is_bounded_over_all_shards_of_a_source(monkeypatch, s3_server):
    """A long run walks through hundreds of remote shards: the source keeps ``CACHE_BLOCKS`` blocks
    in all, not ``CACHE_BLOCKS`` per shard (before: 64 MiB of host memory per shard ever visited,
    per rank — 64 GB per rank after 1,000 FineWeb shards)."""
    import fsspec

    import trainer.data as data

    monkeypatch.setattr(data, "READ_BLOCK_BYTES", 1024)
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("many-shards")
    n_shards, per = 6, 4096  # 8 blocks of 1 KiB per shard
    stream = (np.arange(n_shards * per) * 13) % 50_000
    for i in range(n_shards):
        fs.pipe(f"many-shards/d/train_{i:06d}.bin", encode(stream[i * per:(i + 1) * per], 50_000))
    src = build_source("s3://many-shards/d", seq_len=64, vocab_size=50_000, seed=0)
    for i in range(0, src.total // 64 - 4, 4):  # the whole stream, in order
        assert np.array_equal(src.samples(i, 4), np.stack([stream[(i + j) * 64:(i + j) * 64 + 65] for j in range(4)]))
    for s in src.shards:  # let the read-ahead finish
        for f in list(s._inflight.values()):
            f.result()
    cached = {id(b) for s in src.shards for b in s._blocks.values()}
    assert len(cached) <= data.CACHE_BLOCKS, len(cached)


def test_val_data_naming_a_prepared_folder_validates_on_its_val_shards_only(tmp_path):
    """``trainer.val_data: <the data prepare folder>`` (train_*.bin and val_*.bin side by side)
    must not validate on the training shards (before: every shard in the folder, training included)."""
    train = (np.arange(3000) * 7) % 200
    val = np.full(1000, 199)
    (tmp_path / "train_000000.bin").write_bytes(encode(train, 256))
    (tmp_path / "val_000000.bin").write_bytes(encode(val, 256))
    vsrc = build_val_source(str(tmp_path), str(tmp_path), seq_len=64, vocab_size=256, seed=0)
    assert [f.rsplit("/", 1)[-1] for f in vsrc.files] == ["val_000000.bin"] and vsrc.total == 1000
    # a folder with no validation-named shard is validation data as a whole
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "part_000.bin").write_bytes(encode(val, 256))
    assert build_val_source(str(tmp_path), str(tmp_path / "held"), 64, 256, 0).total == 1000


def test_read_ahead_keeps_several_blocks_in_flight_and_no_more(monkeypatch, s3_server):
    """Small blocks (≈ one GET per step): the next ``READ_AHEAD_BLOCKS`` blocks are requested
    concurrently as soon as a block is used (one block ahead left each request's latency exposed),
    and no further — bounded memory. moto S3; ``cat_file`` wrapped only to hold each request
    0.2 s and count how many overlap."""
    import threading
    import time

    import fsspec

    import trainer.data as data

    assert data.READ_AHEAD_BLOCKS >= 2 and data.READ_AHEAD_BLOCKS < data.CACHE_BLOCKS
    monkeypatch.setattr(data, "READ_BLOCK_BYTES", 1024)
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("ahead-bucket")
    stream = (np.arange(16 * 512) * 7) % 50_000  # 16 blocks of 1 KiB (uint16)
    fs.pipe("ahead-bucket/d/train_000000.bin", encode(stream, 50_000))
    src = build_source("s3://ahead-bucket/d", seq_len=64, vocab_size=50_000, seed=0)
    shard = src.shards[0]
    real, lock, now, peak = shard.fs.cat_file, threading.Lock(), [0], [0]

    def held(*a, **k):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.2)
        try:
            return real(*a, **k)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(shard.fs, "cat_file", held)
    assert np.array_equal(src.samples(0, 1)[0], stream[:65])  # block 0 only
    for f in list(shard._inflight.values()):
        f.result()
    want = set(range(data.READ_AHEAD_BLOCKS + 1))
    assert {k for _, k in shard._blocks} == want
    assert shard.requests == len(want)
    assert peak[0] >= min(data.READ_AHEAD_BLOCKS, 4)  # in flight together, not one after another
