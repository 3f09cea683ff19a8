"""Helpers for trainer tests: write a job spec, launch the real trainer under torchrun (through
``infra/torchrun_launch.py``, which passes the workers' exit codes through), read the run URI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "infra" / "torchrun_launch.py"

def torchrun_script(tmp: Path, source: str | Path, nproc: int, *args: str, timeout: float = 300,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a test script (its text, or a path) under the real torchrun on CPU (gloo, one thread per
    rank) from the repository root; the test fails with the script's output unless it exits 0."""
    if isinstance(source, str):
        path = tmp / "torchrun_script.py"
        path.write_text(source)
    else:
        path = source
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                          str(path), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    return out


class World:
    """What the torchrun world(s) of :func:`run_world` left behind: per case and rank, the output
    (``<case>/rank{r}.log``) and exit code (``<case>/rank{r}.rc``)."""

    def __init__(self, out: Path, nproc: int, cases: list[dict]):
        self.out, self.nproc = out, nproc
        self.cases = {c["name"]: c for c in cases}
        self.launches: list[tuple[int | None, str]] = []  # (torchrun's exit code, its output) per world

    def dir(self, name: str) -> Path:
        return self.out / name

    def _files(self, name: str, ext: str) -> list[Path | None]:
        return [p if p.exists() else None for p in (self.dir(name) / f"rank{r}.{ext}" for r in range(self.nproc))]

    def started(self, name: str) -> bool:
        return any(self._files(name, "log"))

    def finished(self, name: str) -> bool:
        return all(self._files(name, "rc"))

    def case(self, name: str) -> tuple[int, str]:
        """The case's exit code (the first failed rank's; 1 for an exception) and the end of every
        rank's output (3000 characters in all: a test's ``out[-3000:]`` shows each rank's last lines);
        an AssertionError naming the case when its world ended before every rank finished it."""
        each = (3000 - 150) // self.nproc - 20
        logs = "".join(f"--- rank {r} ---\n{p.read_text(errors='replace')[-each:]}"
                       for r, p in enumerate(self._files(name, "log")) if p)
        logs += f"(in full: {self.dir(name)}/rank*.log)\n"
        codes = [p.read_text() if p else None for p in self._files(name, "rc")]
        failed = [1 if c.startswith("exception") else int(c) for c in codes if c and c != "0"]
        if failed:
            return failed[0], logs
        if None in codes:
            torchrun = "".join(f"--- torchrun (exit {rc}) ---\n{out[-2000:]}\n" for rc, out in self.launches)
            raise AssertionError(f"case {name} did not finish on ranks {[r for r, c in enumerate(codes) if c is None]}"
                                 f" (started: {self.started(name)}): its world ended\n{logs}\n{torchrun}")
        return 0, logs


def run_world(tmp: Path, nproc: int, script: Path, cases: list[dict], timeout: float = 500) -> World:
    """Run ``script`` (a worker built on tests/trainer/world_cases.py) under ONE torchrun of
    ``nproc`` ranks on CPU (gloo, one thread per rank) for all ``cases`` (dicts with a ``name``;
    each gets ``out``, its folder), in turn: the interpreters and torch start once, each case still
    has its own output and exit code. A case that fails ends its world; the cases after it run in a
    new one. Never fails itself: each test reads its own case (:meth:`World.case`). ``timeout``
    covers every world, under pytest-timeout's 600 s for the test that starts them."""
    tmp.mkdir(parents=True, exist_ok=True)
    cases = [{**c, "out": str(tmp / c["name"])} for c in cases]
    world = World(tmp, nproc, cases)
    end = time.monotonic() + timeout
    todo = cases
    while todo:
        (tmp / "cases.json").write_text(json.dumps(todo))
        p = subprocess.Popen([sys.executable, str(LAUNCH), "--standalone", f"--nproc-per-node={nproc}", str(script),
                              str(tmp / "cases.json")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                  "PYTHONPATH": str(REPO)})
        try:
            out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            Trainer.kill(p)
            out, _ = p.communicate()
            out += f"\n(killed: {timeout:g} s for every case)"
        finally:
            if p.poll() is None:  # interrupted (pytest-timeout, ^C): no world left behind
                Trainer.kill(p)
                p.wait()
        world.launches.append((p.returncode, out))
        # The first case some rank did not finish: the world ended in it (reported on that case),
        # or before it (not started: it runs again). The rest get a new world, if time is left.
        i = next((k for k, c in enumerate(todo) if not world.finished(c["name"])), None)
        if i is None or not world.started(todo[0]["name"]) or end - time.monotonic() < 60:
            break  # all done; or no case started (the world itself is broken); or out of time
        todo = todo[i + 1:] if world.started(todo[i]["name"]) else todo[i:]
    return world


def worlds_per_size(request: pytest.FixtureRequest, tmp: Path, script: Path,
                    cases: list[tuple[int, dict]]) -> Callable[[int], World]:
    """For a module-scoped fixture: ``get(nproc)`` runs, on its first call for that size, one
    :func:`run_world` of ``script`` with the ``(nproc, case)`` cases of that size whose test is
    selected in this session: ``case["name"]`` is the test's parametrize id, or ``case["tests"]``
    names the test functions that read it (``-k`` still runs only what it picks)."""
    items = [item for item in request.session.items if item.module is request.module]
    wanted = {item.callspec.id for item in items if hasattr(item, "callspec")}
    wanted |= {item.originalname for item in items}
    done: dict[int, World] = {}

    def get(nproc: int) -> World:
        if nproc not in done:
            done[nproc] = run_world(tmp / f"world{nproc}", nproc, script,
                                    [c for n, c in cases if n == nproc
                                     and (c["name"] in wanted or wanted & set(c.get("tests", ())))])
        return done[nproc]
    return get


# A dense model that exercises every TP path: untied head/embedding, QK-norm, SwiGLU, RMSNorm, GQA.
DENSE = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "max_seq_len": 128, "qk_norm": True, "tie_embeddings": False, "mlp": "swiglu", "norm": "rmsnorm"}
# tiny-moe, dropless (the default) and without per-rank aux loss: EP and world 1 compute the same function.
MOE = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128,
       "moe": {"n_experts": 4, "top_k": 2, "balance": "bias"}}


class Trainer:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def job(self, name: str, *, nproc: int, run_uri: str, model: Any = "tiny", parallel: Any = None,
            steps: int = 8, every: int = 4, **trainer: Any) -> Path:
        spec = {
            "name": name,
            "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": nproc},
            "trainer": {"model": model, "parallel": parallel or {"dp_shard": nproc, "tp": 1},
                        "steps": steps, "batch_size": 4, "seq_len": 32, "precision": "fp32",
                        "lr": 0.01, "warmup_steps": 2, "log_every": 1, "heartbeat_seconds": 0.2,
                        **trainer},
            "checkpoint": {"uri": run_uri, "every_steps": every, "keep": 2},
        }
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    def start(self, job: Path, nproc: int, *, run_uri: str | None = None, env: dict | None = None,
              torchrun: bool = True, launch: list[str] | None = None) -> subprocess.Popen:
        """``launch``: torchrun's rendezvous flags instead of ``--standalone`` (one node of several)."""
        if torchrun:
            cmd = [sys.executable, str(LAUNCH), *(launch or ["--standalone"]), f"--nproc-per-node={nproc}",
                   "-m", "trainer", "--job", str(job)]
        else:
            cmd = [sys.executable, "-m", "trainer", "--job", str(job)]
        if run_uri:
            cmd += ["--run-uri", run_uri]
        e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        p = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        self.procs.append(p)
        return p

    def run(self, job: Path, nproc: int, timeout: float = 240, **kw: Any) -> tuple[int, str]:
        p = self.start(job, nproc, **kw)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(p)
            out, _ = p.communicate()
            raise AssertionError(f"trainer timed out:\n{out[-4000:]}")
        return p.returncode, out

    @staticmethod
    def kill(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.kill(p)
                p.wait(timeout=30)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a torchrun rendezvous of several launchers)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(port: int, rank: int) -> list[str]:
    """torchrun's flags for node ``rank`` of a two-node static rendezvous on 127.0.0.1."""
    return ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]


def wait_for(cond, timeout: float = 120, every: float = 0.1, what: str = "condition") -> None:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def losses(run_uri: str) -> list[float]:
    from orchestrator.contract import runuri

    text = runuri.read_text(runuri.join(run_uri, "metrics.jsonl")) or ""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r]  # validation rows carry val_loss only


@pytest.fixture
def trainer(tmp_path):
    t = Trainer(tmp_path)
    yield t
    t.cleanup()
