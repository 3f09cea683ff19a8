"""The pp=1/cp=1 trainer's tokens/s at HEAD ÷ the same at an earlier commit (issue 32: PP/CP must not slow it).

Both commits are checked out into temporary ``git worktree``s (removed after, also on failure or
Ctrl-C); HEAD's worktree holds the commit, not this shared working tree's uncommitted edits. Each
side runs the same job: the bundled trainer on synthetic data, fp32, CPU, FSDP ``dp_shard`` = N
through that worktree's ``infra/torchrun_launch.py --standalone --nproc-per-node=N -m trainer``,
its own code on PYTHONPATH and this venv's packages, one thread per rank. Runs alternate per
round and process count, the side that goes first swapping each round (ref head, head ref, …: the
machine is shared). tokens/s comes from metrics.jsonl between the step ``--warmup`` and the last
logged step (start-up, the warm-up steps and the final checkpoint excluded), as in
bench_throughput.py.

    .venv/bin/python benchmarks/bench_vs_ref.py [--ref HEAD~1] [--procs 1 2] [--steps 25] [--rounds 2]
        [--d-model 256 --layers 6 --seq 2048 --batch 8]

Prints one JSON object: per process count each side's tokens/s (every round, best, median), the
ratio head ÷ ref (best ÷ best, and the median of the per-round ratios), the spread between rounds,
the load average before/after and a verdict against the target ratio ≥ 0.98. Exit 0 whatever the
verdict; 2 (one line) when it cannot run: a REF that is not a commit, a dirty REF (one that git
would read as an option, or the working tree itself), git or the trainer failing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.98


class CannotRun(Exception):
    pass


def _git(*args: str, cwd: Path = REPO) -> str:
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise CannotRun(f"git {' '.join(args)} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return r.stdout.strip()


def resolve(ref: str) -> str:
    """REF → a full commit id, or CannotRun with one line."""
    if not ref or ref.startswith("-") or not re.fullmatch(r"[\w./~^@{}+-]+", ref) or ref.endswith("-dirty"):
        raise CannotRun(f"--ref {ref!r}: not a clean revision name (no options, spaces or a -dirty tree)")
    r = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"],
                       cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise CannotRun(f"--ref {ref!r}: not a commit in {REPO}")
    return r.stdout.strip()


def job_file(tmp: Path, name: str, a: argparse.Namespace, nproc: int) -> Path:
    import yaml

    model = {"vocab_size": 256, "d_model": a.d_model, "n_layers": a.layers, "n_heads": max(1, a.d_model // 32),
             "max_seq_len": a.seq}
    spec = {"name": name, "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": nproc},
            "trainer": {"model": model, "parallel": {"dp_shard": nproc}, "steps": a.steps, "batch_size": a.batch,
                        "seq_len": a.seq, "precision": "fp32", "lr": 3e-3, "log_every": 1,
                        "heartbeat_seconds": 3600},
            "checkpoint": {"uri": f"file://{tmp}/{name}/run", "every_steps": 100000}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_trainer(tree: Path, job: Path, run_dir: Path, nproc: int, a: argparse.Namespace) -> float:
    """One trainer run in worktree ``tree``; its tokens/s after the warm-up steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "infra" / "torchrun_launch.py"), "--standalone", f"--nproc-per-node={nproc}",
           "-m", "trainer", "--job", str(job)]
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)  # its own group: an interrupt ends torchrun and every rank
    try:
        out, _ = p.communicate(timeout=a.timeout)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    if p.returncode != 0:
        tail = " | ".join(out.strip().splitlines()[-3:])
        raise CannotRun(f"trainer in {tree.name} exited {p.returncode}: {tail[-400:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "loss" in r and r["step"] >= a.warmup]
    if len(rows) < 2:
        raise CannotRun(f"metrics.jsonl in {tree.name}: fewer than 2 steps after warm-up {a.warmup}")
    first, last = rows[0], rows[-1]
    return (last["step"] - first["step"]) * a.batch * a.seq / (last["time"] - first["time"])


def summarise(ref: list[float], head: list[float]) -> dict:
    per_round = [h / r for h, r in zip(head, ref)]
    spread = lambda xs: round((max(xs) - min(xs)) / statistics.median(xs), 3)  # noqa: E731
    ratio = max(head) / max(ref)
    return {"ref_tokens_per_s": [round(x, 1) for x in ref], "head_tokens_per_s": [round(x, 1) for x in head],
            "ref_best": round(max(ref), 1), "ref_median": round(statistics.median(ref), 1),
            "head_best": round(max(head), 1), "head_median": round(statistics.median(head), 1),
            "ratio_best": round(ratio, 3), "ratio_median_of_rounds": round(statistics.median(per_round), 3),
            "ratio_per_round": [round(x, 3) for x in per_round],
            "round_spread": {"ref": spread(ref), "head": spread(head)},
            "met": ratio >= TARGET}


def measure(a: argparse.Namespace, ref_sha: str, head_sha: str, tmp: Path) -> dict:
    trees = {"ref": tmp / "ref", "head": tmp / "head"}
    for side, sha in (("ref", ref_sha), ("head", head_sha)):
        _git("worktree", "add", "--detach", "--quiet", str(trees[side]), sha)
    load_before = os.getloadavg()
    res: dict = {"benchmark": "vs_ref", "ref": ref_sha[:12], "head": head_sha[:12], "device": "cpu",
                 "d_model": a.d_model, "layers": a.layers, "seq_len": a.seq, "global_batch": a.batch,
                 "steps": a.steps, "warmup_steps": a.warmup, "rounds": a.rounds, "precision": "fp32",
                 "target_ratio": TARGET, "load_before": [round(x, 2) for x in load_before]}
    for n in a.procs:
        got: dict[str, list[float]] = {"ref": [], "head": []}
        for rnd in range(a.rounds):
            for side in ("ref", "head") if rnd % 2 == 0 else ("head", "ref"):  # ABBA: no side always first
                name = f"{side}-p{n}-r{rnd}"
                job = job_file(tmp, name, a, n)
                got[side].append(run_trainer(trees[side], job, tmp / name / "run", n, a))
        res[f"procs_{n}"] = summarise(got["ref"], got["head"])
    res["load_after"] = [round(x, 2) for x in os.getloadavg()]
    worst = max(max(res[f"procs_{n}"]["round_spread"].values()) for n in a.procs)
    met = all(res[f"procs_{n}"]["met"] for n in a.procs)
    res["verdict"] = (f"{'met' if met else 'NOT met'}: head/ref best÷best "
                      + ", ".join(f"{res[f'procs_{n}']['ratio_best']} at {n} proc" for n in a.procs)
                      + f" (target ≥ {TARGET}); "
                      + (f"rounds differ by up to {worst:.1%} of the median, so a ratio within ±{worst:.2f} of 1"
                         " is noise on this machine" if a.rounds > 1 else "one round: the noise is not measured"))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default="HEAD~1")
    ap.add_argument("--head", default="HEAD", help="the commit to compare (its worktree, not the working tree)")
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per trainer run")
    a = ap.parse_args(argv)
    tmp = None
    try:
        if a.steps < a.warmup + 2 or a.rounds < 1 or any(n < 1 or a.batch % n for n in a.procs):
            raise CannotRun("--steps must be ≥ --warmup + 2, --rounds ≥ 1, --batch divisible by every --procs")
        ref_sha, head_sha = resolve(a.ref), resolve(a.head)
        tmp = Path(tempfile.mkdtemp(prefix="bench_vs_ref-"))
        res = measure(a, ref_sha, head_sha, tmp)
    except CannotRun as e:
        print(f"bench_vs_ref: cannot run: {e}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            for side in ("ref", "head"):
                if (tmp / side).exists():
                    subprocess.run(["git", "worktree", "remove", "--force", str(tmp / side)], cwd=REPO,
                                   capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))  # SIGTERM like Ctrl-C: the finally removes the worktrees
    sys.exit(main())
