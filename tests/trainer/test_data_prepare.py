"""``dtrun data prepare``: shards equal the tokenized corpus, the manifest counts are the shards'
contents, an interrupted run resumes to the same bytes without redoing finished shards, output on
S3 (moto), and each bad input is one clear error with nothing left under ``--out``.

Real parts throughout: the ``tokenizers`` library (a BPE trained here in a second), the
``dtrun`` CLI entry point, multiprocessing workers, a moto S3 server.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.cli.app import main as dtrun
from trainer import shards
from trainer.prepare import EXIT_DEBUG_STOP, MANIFEST, STATE, STOP_ENV, UNIT_BYTES_ENV, prepare
from trainer.tokenizer import load, train_bpe

REPO = Path(__file__).resolve().parents[2]

WORDS = ("the model reads tokens from shards and learns to predict the next one while the loss goes down "
         "checkpoint resume validation tokenizer manifest parquet jsonl corpus").split()


def _text(rng: np.random.Generator, n: int) -> str:
    paras = []
    for _ in range(n):
        paras.append(" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) + ".")
    return "\n\n".join(paras)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    src = root / "src"
    (src / "sub").mkdir(parents=True)
    texts = []
    for i in range(6):
        t = _text(rng, 60)
        (src / f"doc{i}.txt").write_text(t)
        texts.append(t)
    t = _text(rng, 40)
    (src / "sub" / "deep.md").write_text(t)
    jl = [_text(rng, 3) for _ in range(20)]
    (src / "lines.jsonl").write_text("\n".join(json.dumps({"text": x, "id": i}) for i, x in enumerate(jl)) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pt = [_text(rng, 2) for _ in range(30)]
    pq.write_table(pa.table({"text": pt}), src / "rows.parquet", row_group_size=10)
    tok_path = root / "tokenizer.json"
    train_bpe(sorted(str(p) for p in src.rglob("*.txt")), 300, str(tok_path))
    return {"src": src, "tok": str(tok_path), "root": root}


def _expected_stream(corpus: dict) -> np.ndarray:
    """What the shards must hold: every document in source order, each after an end-of-text token."""
    import pyarrow.parquet as pq

    tok = load(corpus["tok"])
    docs = []
    for p in sorted(str(x) for x in corpus["src"].rglob("*") if x.is_file()):
        if p.endswith((".txt", ".md")):
            docs.append(Path(p).read_text())
        elif p.endswith(".jsonl"):
            docs += [json.loads(line)["text"] for line in Path(p).read_text().splitlines() if line.strip()]
        elif p.endswith(".parquet"):
            docs += pq.read_table(p).column("text").to_pylist()
    out = []
    for ids in tok.encode_batch(docs):
        out += [tok.eot] + ids
    return np.array(out, dtype=np.int64)


def _read_all(out: Path, names: list[str]) -> np.ndarray:
    import fsspec

    fs = fsspec.filesystem("file")
    parts = []
    for n in names:
        info = shards.read_info(fs, str(out / n))
        parts.append(np.fromfile(out / n, dtype=info.dtype, offset=info.offset, count=info.n_tokens).astype(np.int64))
    return np.concatenate(parts)


def test_shards_hold_the_corpus_and_the_manifest_counts_them(corpus, tmp_path):
    out = tmp_path / "out"
    rc = dtrun(["data", "prepare", str(corpus["src"]), "--out", str(out), "--tokenizer", corpus["tok"],
                "--val-tokens", "1500", "--shard-tokens", "4000", "--workers", "2", "-q"])
    assert rc == 0
    m = json.loads((out / MANIFEST).read_text())
    assert m["vocab_size"] == 300 and m["dtype"] == "uint16" and m["tokenizer"]["eot"] == 0
    assert m["tokenizer"]["sha256"] == hashlib.sha256(Path(corpus["tok"]).read_bytes()).hexdigest()
    assert (out / "tokenizer.json").read_bytes() == Path(corpus["tok"]).read_bytes()
    assert m["val"]["tokens"] == 1500 and [s["name"] for s in m["val"]["shards"]] == ["val_000000.bin"]
    # counts and hashes in the manifest are the shards' contents
    for split in ("train", "val"):
        for s in m[split]["shards"]:
            data = (out / s["name"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == s["sha256"]
            assert shards.parse_header(s["name"], data[:shards.HEADER_BYTES], len(data)).n_tokens == s["tokens"]
        assert m[split]["tokens"] == sum(s["tokens"] for s in m[split]["shards"])
    assert all(s["tokens"] == 4000 for s in m["train"]["shards"][:-1])
    # validation first, then training: together exactly the tokenized corpus, in source order
    names = [s["name"] for s in m["val"]["shards"]] + [s["name"] for s in m["train"]["shards"]]
    got = _read_all(out, names)
    want = _expected_stream(corpus)
    assert got.shape == want.shape and np.array_equal(got, want)
    assert m["documents"] == 6 + 1 + 20 + 30
    assert not (out / STATE).exists()
    # the training loader never reads the validation shard
    from trainer.data import ShardSource

    src = ShardSource(str(out), 16, 300)
    assert [os.path.basename(s.path) for s in src.shards] == [s["name"] for s in m["train"]["shards"]]


def _prepare_cli(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "data", "prepare", *args], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=300)


def test_interrupted_prepare_resumes_to_the_same_bytes(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv(UNIT_BYTES_ENV, "8192")  # many work units in this small corpus
    args = [str(corpus["src"]), "--tokenizer", corpus["tok"], "--val-tokens", "1000", "--shard-tokens", "2500",
            "--workers", "2", "-q"]
    clean = tmp_path / "clean"
    assert _prepare_cli(args + ["--out", str(clean)]).returncode == 0
    out = tmp_path / "resumed"
    p = _prepare_cli(args + ["--out", str(out)], env={STOP_ENV: "3"})  # killed after 3 shards
    assert p.returncode == EXIT_DEBUG_STOP, p.stderr
    assert (out / STATE).exists() and not (out / MANIFEST).exists()
    done = json.loads((out / STATE).read_text())["shards"]
    assert len(done) == 3
    before = {s["name"]: os.stat(out / s["name"]).st_mtime_ns for s in done}
    from trainer.prepare import Progress

    seen: list[Progress] = []
    prepare(str(corpus["src"]), str(out), tokenizer=corpus["tok"], val_tokens=1000, shard_tokens=2500, workers=2,
            on_progress=seen.append)
    assert seen[0].skipped_units > 0  # finished units were not tokenized again
    assert {n: os.stat(out / n).st_mtime_ns for n in before} == before  # finished shards not rewritten
    assert sorted(os.listdir(out)) == sorted(os.listdir(clean))
    for name in os.listdir(clean):
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    # a rerun of a finished preparation is a no-op
    assert prepare(str(corpus["src"]), str(out), tokenizer=corpus["tok"], val_tokens=1000, shard_tokens=2500,
                   workers=1)["config"] == json.loads((clean / MANIFEST).read_text())["config"]


def test_prepare_to_s3(corpus, s3_bucket):
    import fsspec

    from orchestrator.contract import runuri

    uri = f"{s3_bucket}/data/docs"
    rc = dtrun(["data", "prepare", str(corpus["src"] / "lines.jsonl"), "--out", uri, "--tokenizer", corpus["tok"],
                "--val-tokens", "200", "--shard-tokens", "1000", "-q"])
    assert rc == 0
    m = runuri.read_json(runuri.join(uri, MANIFEST))
    fs, path = runuri._fs(uri)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    assert names == sorted([MANIFEST, "tokenizer.json"] + [s["name"] for s in m["train"]["shards"] + m["val"]["shards"]])
    total = sum(shards.read_info(fs, path + "/" + s["name"]).n_tokens for s in m["train"]["shards"])
    assert total == m["train"]["tokens"] > 0
    assert isinstance(fs, fsspec.AbstractFileSystem)


def _bad(capsys, args: list[str]) -> str:
    rc = dtrun(["data", "prepare", *args, "-q"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_bad_inputs_are_one_clear_error_and_leave_nothing(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "corpus is empty" in _bad(capsys, [str(empty), "--out", str(out), "--tokenizer", corpus["tok"]])
    (empty / "blank.txt").write_text("")
    assert "corpus is empty" in _bad(capsys, [str(empty), "--out", str(out), "--tokenizer", corpus["tok"]])
    err = _bad(capsys, [str(corpus["src"]), "--out", str(out), "--tokenizer", "no-such-tokenizer"])
    assert "unknown tokenizer 'no-such-tokenizer'" in err
    err = _bad(capsys, [str(corpus["src"]), "--out", str(out), "--tokenizer", "someorg/somemodel"])
    assert "not in the local Hugging Face cache" in err and "huggingface-cli download" in err
    assert not out.exists()

    # an unreadable file in the middle of the corpus: found after shards were already written
    bad = tmp_path / "badsrc"
    bad.mkdir()
    rng = np.random.default_rng(1)
    (bad / "a.txt").write_text(_text(rng, 300))
    (bad / "b.txt").write_bytes(b"fine start \xff\xfe not utf-8")
    (bad / "c.txt").write_text(_text(rng, 50))
    err = _bad(capsys, [str(bad), "--out", str(out), "--tokenizer", corpus["tok"], "--val-tokens", "100",
                        "--shard-tokens", "500"])
    assert "b.txt: not UTF-8 text" in err
    assert not out.exists()  # the shards written before the bad file are gone again

    (bad / "b.txt").unlink()
    (bad / "d.parquet").write_bytes(b"PAR1 garbage")
    err = _bad(capsys, [str(bad), "--out", str(out), "--tokenizer", corpus["tok"]])
    assert "d.parquet: not a readable Parquet file" in err
    # a corpus too small for the validation split asked for
    (bad / "d.parquet").unlink()
    err = _bad(capsys, [str(bad / "c.txt"), "--out", str(out), "--tokenizer", corpus["tok"], "--val-tokens", "10000000"])
    assert "--val-tokens" in err
    assert not out.exists()


def test_tiktoken_gpt2_not_cached_says_what_to_download(tmp_path, monkeypatch):
    """No vocabulary file in TIKTOKEN_CACHE_DIR and no network: one error naming the download."""
    from trainer.tokenizer import TokenizerError

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # never reach out, even where a network exists
    with pytest.raises(TokenizerError, match="tiktoken.get_encoding\\('gpt2'\\)"):
        load("gpt2")


def test_model_vocab_smaller_than_the_tokenizer_is_refused_before_renting(corpus, tmp_path, dtrun_home, capsys):
    import yaml

    out = tmp_path / "data"
    prepare(str(corpus["src"] / "doc0.txt"), str(out), tokenizer=corpus["tok"], val_tokens=100, workers=1)
    job = tmp_path / "job.yaml"
    model = {"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
    job.write_text(yaml.safe_dump({
        "name": "vocab-check", "resources": {"providers": ["local"], "gpu": "cpu"},
        "trainer": {"model": model, "steps": 2, "batch_size": 2, "seq_len": 16, "data": str(out)},
        "checkpoint": {"uri": str(tmp_path / "run")}}))
    for args in (["up", str(job), "--dry-run"], ["up", str(job), "--yes"]):
        rc = dtrun(args)
        err = capsys.readouterr().err
        assert rc == 2 and "vocab_size 256 is smaller than" in err and "300" in err and "nothing rented" in err
    assert not (tmp_path / "run").exists()
    # the trainer itself refuses too (a run started without dtrun up)
    p = subprocess.run([sys.executable, "-m", "trainer", "--job", str(job)], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert p.returncode == 2 and "vocab_size 256 is smaller than" in p.stderr


def test_validation_data_with_a_larger_vocabulary_is_refused_before_renting(corpus, tmp_path, dtrun_home, capsys):
    import yaml

    out = tmp_path / "valdata"  # a 300-token tokenizer's shards, named as trainer.val_data only
    prepare(str(corpus["src"] / "doc0.txt"), str(out), tokenizer=corpus["tok"], val_tokens=100, workers=1)
    job = tmp_path / "job.yaml"
    model = {"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
    job.write_text(yaml.safe_dump({
        "name": "val-vocab-check", "resources": {"providers": ["local"], "gpu": "cpu"},
        "trainer": {"model": model, "steps": 2, "batch_size": 2, "seq_len": 16, "data": "synthetic",
                    "val_data": str(out / "val_*.bin"), "eval_every": 1},
        "checkpoint": {"uri": str(tmp_path / "run")}}))
    rc = dtrun(["up", str(job), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and "vocab_size 256 is smaller than" in err and "300" in err and "nothing rented" in err, err


def test_default_validation_split_is_a_tenth_of_a_small_corpus(corpus, tmp_path, capsys):
    """A 50k-token corpus prepares without --val-tokens (it stopped at 1,000,000 before, issue 23)."""
    out = tmp_path / "out"
    rc = dtrun(["data", "prepare", str(corpus["src"]), "--out", str(out), "--tokenizer", corpus["tok"],
                "--shard-tokens", "4000", "--workers", "1", "-q"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    m = json.loads((out / MANIFEST).read_text())
    total = m["train"]["tokens"] + m["val"]["tokens"]
    assert total == len(_expected_stream(corpus))
    assert m["val"]["tokens"] == m["val_tokens"] == total // 10 > 0
    assert "a tenth of the corpus, at most 1,000,000" in printed
    # the split is still the start of the stream: validation first, then training, in source order
    names = [s["name"] for s in m["val"]["shards"]] + [s["name"] for s in m["train"]["shards"]]
    assert np.array_equal(_read_all(out, names), _expected_stream(corpus))


def test_default_validation_split_is_capped(corpus, tmp_path, monkeypatch):
    """Above VAL_FRACTION × the cap the split is the cap, decided while reading (not at the end)."""
    import trainer.prepare as tp

    monkeypatch.setattr(tp, "VAL_TOKENS_CAP", 700)  # stands in for 1M: the corpus holds > 10 × 700 tokens
    assert tp.auto_val_tokens(10 ** 9) == 700 and tp.auto_val_tokens(5000) == 500
    monkeypatch.setenv(UNIT_BYTES_ENV, "8192")
    m = prepare(str(corpus["src"]), str(tmp_path / "out"), tokenizer=corpus["tok"], shard_tokens=2500, workers=1)
    assert m["val"]["tokens"] == m["val_tokens"] == 700
    assert m["train"]["tokens"] + 700 == len(_expected_stream(corpus))


def test_interrupted_prepare_with_the_default_split_resumes_to_the_same_bytes(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv(UNIT_BYTES_ENV, "8192")
    args = [str(corpus["src"]), "--tokenizer", corpus["tok"], "--shard-tokens", "2500", "--workers", "1", "-q"]
    clean = tmp_path / "clean"
    assert _prepare_cli(args + ["--out", str(clean)]).returncode == 0
    out = tmp_path / "resumed"
    assert _prepare_cli(args + ["--out", str(out)], env={STOP_ENV: "2"}).returncode == EXIT_DEBUG_STOP
    assert json.loads((out / STATE).read_text())["val_tokens"] > 0  # the resolved split is kept for the rerun
    assert _prepare_cli(args + ["--out", str(out)]).returncode == 0
    assert sorted(os.listdir(out)) == sorted(os.listdir(clean))
    for name in os.listdir(clean):
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name


def _vocab(path) -> dict:
    return json.loads(Path(path).read_text())["model"]["vocab"]


def test_tokenizer_reads_every_source_prepare_reads(corpus, tmp_path, capsys):
    """JSONL and Parquet too (it skipped .jsonl and refused a folder of only JSONL before)."""
    jl = tmp_path / "jl"
    jl.mkdir()
    docs = ["zyzzyva quokka " * 30, "quokka zyzzyva " * 30]
    (jl / "a.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs) + "\n")
    out = tmp_path / "tok.json"
    assert dtrun(["data", "tokenizer", str(jl), "--out", str(out), "--vocab-size", "300", "--text-field", "body"]) == 0
    assert "Ġquokka" in _vocab(out) and "Ġzyzzyva" in _vocab(out)
    # a mixed folder: the JSONL and Parquet documents are learned from as well as the text files
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "t.txt").write_text("plain words " * 50)
    (mixed / "b.jsonl").write_text(json.dumps({"text": "wombatish " * 50}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["platypusy " * 50]}), mixed / "c.parquet")
    out2 = tmp_path / "tok2.json"
    assert dtrun(["data", "tokenizer", str(mixed), "--out", str(out2), "--vocab-size", "400"]) == 0
    v = _vocab(out2)
    assert "Ġwombatish" in v and "Ġplatypusy" in v and "Ġwords" in v
    capsys.readouterr()
    # a bad JSONL line is one clear error
    (jl / "bad.jsonl").write_text("{not json\n")
    assert dtrun(["data", "tokenizer", str(jl), "--out", str(tmp_path / "t3.json"), "--text-field", "body"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "not JSON" in err and "Traceback" not in err


def test_tokenizer_warns_when_the_corpus_supports_a_smaller_vocabulary(tmp_path, capsys):
    src = tmp_path / "small.txt"
    src.write_text("the cat sat on the mat. " * 40)
    out = tmp_path / "tok.json"
    assert dtrun(["data", "tokenizer", str(src), "--out", str(out), "--vocab-size", "8192"]) == 0
    cap = capsys.readouterr()
    n = len(_vocab(out))
    assert n < 8192 and f"vocabulary {n:,}" in cap.out
    assert "warning" in cap.err and "8,192" in cap.err and f"only {n:,}" in cap.err
    assert dtrun(["data", "tokenizer", str(src), "--out", str(out), "--vocab-size", str(n)]) == 0
    assert "warning" not in capsys.readouterr().err
