"""``dtrun data prepare`` throughput: all cores vs one, and vs the tokenizer's own batch API.

Corpus: this Python's standard-library docstrings (examples/stdlib_corpus.py), copied COPIES
times under new names (~6.5 MB of text). Tokenizer: a byte-level BPE with an 8192-token vocabulary
trained on one copy. Measured (wall clock, best of 3 interleaved repetitions since the machine may be shared; whole
command: planning, workers' start-up, shards, manifest):

* ``prepare --workers 1`` and ``prepare --workers <cores>`` into fresh folders;
* the same documents through ``tokenizers``' ``encode_batch`` in one process (its Rust thread pool
  uses every core; no shards written): the ceiling a single process reaches with that library.

    .venv/bin/python benchmarks/bench_data_prepare.py

Prints one JSON object; target: speedup_all_vs_one ≥ 1.7 on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

COPIES = int(os.environ.get("BENCH_COPIES", "4"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))


def main() -> None:
    from stdlib_corpus import build

    from trainer.prepare import prepare
    from trainer.tokenizer import train_bpe

    tmp = Path(tempfile.mkdtemp(prefix="dtrun-bench-prep-"))
    try:
        base = tmp / "base"
        build(base, max_mb=100)
        corpus = tmp / "corpus"
        corpus.mkdir()
        for i in range(COPIES):
            for f in base.iterdir():
                shutil.copy(f, corpus / f"c{i}_{f.name}")
        nbytes = sum(f.stat().st_size for f in corpus.iterdir())
        tok = train_bpe(sorted(str(f) for f in base.iterdir()), 8192, str(tmp / "tokenizer.json"))
        cores = os.cpu_count() or 1
        res: dict = {"corpus_mb": round(nbytes / 1e6, 2), "files": COPIES * len(list(base.iterdir())),
                     "vocab": tok.vocab_size, "cores": cores}
        res["load_average_before"] = os.getloadavg()[0]
        docs = [f.read_text() for f in sorted(corpus.iterdir())]
        best: dict[str, float] = {}
        for rep in range(REPEATS):  # interleaved, best of REPEATS: the machine may be shared
            for label, workers in (("one_core", 1), ("all_cores", cores)):
                out = tmp / f"out_{label}"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                m = prepare(str(corpus), str(out), tokenizer=str(tmp / "tokenizer.json"),
                            val_tokens=100_000, shard_tokens=10_000_000, workers=workers)
                best[label] = min(best.get(label, 1e9), time.perf_counter() - t0)
                res["tokens"] = m["train"]["tokens"] + m["val"]["tokens"]
            t0 = time.perf_counter()
            enc = tok._impl.encode_batch(docs, add_special_tokens=False)
            best["batch_api"] = min(best.get("batch_api", 1e9), time.perf_counter() - t0)
            assert sum(len(e.ids) for e in enc) + len(docs) == res["tokens"]  # + one end-of-text per file
        for label, dt in best.items():
            res[f"{label}_s"] = round(dt, 2)
            res[f"{label}_tokens_per_s"] = round(res["tokens"] / dt)
        res["load_average_after"] = os.getloadavg()[0]
        res["speedup_all_vs_one"] = round(res["all_cores_tokens_per_s"] / res["one_core_tokens_per_s"], 2)
        res["all_cores_vs_batch_api"] = round(res["all_cores_tokens_per_s"] / res["batch_api_tokens_per_s"], 2)
        same = all((tmp / "out_one_core" / f).read_bytes() == (tmp / "out_all_cores" / f).read_bytes()
                   for f in os.listdir(tmp / "out_one_core"))
        res["identical_output"] = same
        print(json.dumps(res))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
