"""Modal, run for real: ``dtrun up`` through the real ``modal`` 1.6.4 client against the Modal lab
(``tests/e2e/clouds/modal_lab``: a local control plane whose sandboxes are real processes), moto S3 on
127.0.0.1 for the run URI, a tiny model on 2 CPU ranks (torchrun, gloo) inside the sandbox.

The lab is driven as another check would drive it: ``python -m tests.e2e.clouds.modal_lab serve
--execute`` in its own process, faults through its CLI; ``dtrun`` is the real CLI in subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import yaml

from tests.e2e.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
LAB = [PY, "-m", "tests.e2e.clouds.modal_lab"]


# The lab emulates no GPUs: the jobs ask for T4s (priced, placed and billed as Modal's T4) and
# say `trainer.device: cpu`, the explicit way to train CPU ranks on a GPU node (the trainer refuses
# a GPU spec without CUDA otherwise: no silent fallback).


def _lab_pids(root: Path) -> list[int]:
    """Processes of any lab sandbox (their cwd or environment is under the lab's root)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            env = Path(f"/proc/{d}/environ").read_bytes()
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if b"MODAL_TASK_ID=" in env and str(root).encode() in env:
            out.append(int(d))
    return out


class Lab:
    """The lab server in its own process, and its CLI."""

    def __init__(self, root: Path, env: dict[str, str], grace: float = 15.0, extra: list[str] = ()) -> None:
        self.root = root
        self.env = env
        self.proc = subprocess.Popen([*LAB, "serve", "--execute", "--root", str(root), "--grace", str(grace), *extra],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=open(root / "serve.log", "w"),
                                     text=True)
        got = {}
        for _ in range(2):
            line = self.proc.stdout.readline().strip()
            assert "=" in line, f"lab did not start: {line!r} {(root / 'serve.log').read_text()}"
            k, v = line.split("=", 1)
            got[k] = v
        self.url, self.control = got["MODAL_SERVER_URL"], got["MODAL_LAB_CONTROL"]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([*LAB, "--control", self.control, *args], cwd=REPO, env=self.env,
                           capture_output=True, text=True, timeout=60)
        if check:
            assert r.returncode == 0, r.stderr
        return r

    def status(self) -> list[dict]:
        return json.loads(self.cli("status", "--json").stdout)

    def bill(self) -> dict:
        return json.loads(self.cli("bill", "--json").stdout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def world(tmp_path, s3_bucket, monkeypatch):
    """The lab, moto S3, a DTRUN_HOME and the environment `dtrun` runs with."""
    root = tmp_path / "lab"
    root.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODAL_", "DTRUN_", "PYTEST"))}
    env.update(PYTHONPATH=str(REPO), HOME=str(home), DTRUN_HOME=str(tmp_path / "dtrun-home"),
               MODAL_TOKEN_ID="ak-lab", MODAL_TOKEN_SECRET="as-lab", DTRUN_MODAL_GPU_WAIT_SECONDS="3")
    labs: list[Lab] = []

    class World:
        bucket = s3_bucket
        tmp = tmp_path

        def lab(self, **kw) -> Lab:
            lab = Lab(root, env, **kw)
            labs.append(lab)
            env["MODAL_SERVER_URL"] = lab.url
            return lab

        def job(self, name: str, steps: int = 40, **over) -> Path:
            d = {
                "name": name,
                "resources": {"providers": ["modal"], "gpu": "T4", "gpus_per_node": 2},
                "trainer": {"model": "tiny", "device": "cpu", "parallel": {"dp_shard": 2}, "steps": steps, "batch_size": 8,
                            "seq_len": 64, "precision": "fp32", "lr": 0.003, "warmup_steps": 5, "log_every": 5,
                            "heartbeat_seconds": 0.5},
                "checkpoint": {"uri": f"{s3_bucket}/runs/{name}", "every_steps": 10, "keep": 2},
                "budget": {"max_usd": 1.0, "max_hours": 1},
                "recovery": {"poll_seconds": 0.5, "backoff_seconds": 0, "heartbeat_timeout_seconds": 120},
            }
            for k, v in over.items():
                d.setdefault(k, {}).update(v)
            p = tmp_path / f"{name}.yaml"
            p.write_text(yaml.safe_dump(d))
            return p

        def dtrun(self, *args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
            return subprocess.run([PY, "-m", "orchestrator.cli.app", *args], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=timeout, **kw)

        def popen(self, *args: str) -> subprocess.Popen:
            return subprocess.Popen([PY, "-m", "orchestrator.cli.app", *args], cwd=tmp_path, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)

        def state(self, name: str) -> dict:
            return json.loads(self.dtrun("status", name, "--json").stdout)

        def attempts(self, name: str) -> list[dict]:
            from orchestrator.run.state import StateStore

            store = StateStore(Path(env["DTRUN_HOME"]) / "state.db")
            try:
                return store.attempts(name)
            finally:
                store.close()

        def job_row(self, name: str) -> dict:
            from orchestrator.run.state import StateStore

            store = StateStore(Path(env["DTRUN_HOME"]) / "state.db")
            try:
                return store.get_job(name)
            finally:
                store.close()

    w = World()
    w.env = env
    yield w
    for lab in labs:
        lab.close()
    assert _lab_pids(root) == [], "a sandbox process outlived the lab"


def _read(uri: str, name: str) -> dict:
    from orchestrator.contract import runuri

    return runuri.read_json(runuri.join(uri, name))


@pytest.mark.timeout(600)
def test_up_on_modal_succeeds_and_spend_matches_the_bill(world):
    lab = world.lab()
    r = world.dtrun("up", str(world.job("mlab-ok")), "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    st = world.state("mlab-ok")
    assert st["state"] == "SUCCEEDED", st
    done = _read(f"{world.bucket}/runs/mlab-ok", "DONE")
    assert done["step"] == 40
    (sb,) = lab.status()
    assert sb["state"] == "success" and sb["exitcode"] == 0 and sb["gpu"] == "T4:2"
    bill = lab.bill()
    print(json.dumps(st, indent=1), json.dumps(bill, indent=1))
    assert sb["ended_at"] is not None  # the sandbox ended (nothing left billing)
    # spend booked by dtrun (from the launch request to the confirmed end) ≈ the lab's bill
    # (process start to end): dtrun's is an upper bound by the create and terminate round trips
    assert bill["usd"] > 0
    assert bill["usd"] <= st["cost_usd"] <= bill["usd"] * 1.25 + 0.002, (st["cost_usd"], bill)


_wait = partial(wait_until, every=0.5)


def _step(w, name: str) -> int:
    return w.state(name).get("step") or 0


def _local_reference(w, name: str, steps: int) -> str:
    """The same training uninterrupted on the local provider (2 CPU ranks): its param digest."""
    d = yaml.safe_load(w.job(name, steps=steps).read_text())
    d["resources"] = {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 2}
    d["checkpoint"]["uri"] = str(w.tmp / "runs" / name)
    p = w.tmp / f"{name}-local.yaml"
    p.write_text(yaml.safe_dump(d))
    r = w.dtrun("up", str(p), "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    return _read(f"file://{w.tmp}/runs/{name}", "DONE")["param_digest"]


@pytest.mark.timeout(900)
def test_eviction_mid_run_resumes_bit_identical_to_an_uninterrupted_local_run(world):
    lab = world.lab()
    ref = _local_reference(world, "mlab-ref", 60)
    up = world.popen("up", str(world.job("mlab-ev", steps=60)), "--yes")
    uri = f"{world.bucket}/runs/mlab-ev"
    from orchestrator.contract import runuri

    _wait(lambda: (runuri.latest_committed(uri) or (0,))[0] >= 10, 300, "a committed checkpoint")
    lab.cli("evict", "dtrun-mlab-ev-a1")
    out, _ = up.communicate(timeout=600)
    assert up.returncode == 0, out
    st = world.state("mlab-ev")
    assert st["state"] == "SUCCEEDED", out
    atts = world.attempts("mlab-ev")
    assert [a["outcome"] for a in atts] == ["preempted", "succeeded"], atts
    assert "evicted" in (atts[0].get("reason") or "").lower() or "evict" in out.lower()
    assert atts[1]["start_step"] >= 10
    done = _read(uri, "DONE")
    assert done["step"] == 60
    assert done["param_digest"] == ref  # bit-identical final parameters
    sbs = lab.status()
    assert [s["state"] for s in sbs] == ["eviction", "success"]


@pytest.mark.timeout(900)
def test_the_sandbox_cap_compressed_is_a_planned_restart_without_lost_steps(world):
    lab = world.lab()
    # Modal's 24-hour cap made 250 s through the variables the adapter sends (the sandbox's
    # timeout, DTRUN_NODE_TIMEOUT_SECONDS, DTRUN_RESTART_GRACE_SECONDS): the node's watchdog stops
    # for a planned restart its margins (2 checks + STOP and SIGTERM graces: 180 s by default)
    # plus the 10 s grace before that, ~60 s after the node starts. The job is far longer than one
    # window on any machine (20k steps), so the restart happens whatever the speed; the test ends
    # it with `dtrun down` once the second sandbox has trained past the restart's checkpoint.
    world.env.update(DTRUN_MODAL_MAX_TIMEOUT_SECONDS="250", DTRUN_MODAL_RESTART_GRACE_SECONDS="10")
    r = world.dtrun("up", str(world.job("mlab-cap", steps=20000)), "--yes", "--detach")
    assert r.returncode == 0, r.stdout + r.stderr

    def resumed_and_training():
        atts = world.attempts("mlab-cap")
        if len(atts) < 2 or not atts[1].get("start_step"):
            return None
        return atts if _step(world, "mlab-cap") > atts[1]["start_step"] else None

    atts = _wait(resumed_and_training, 600, "a second sandbox training past the planned restart's checkpoint")
    assert atts[0]["outcome"] == "planned_restart", atts
    d = world.dtrun("down", "mlab-cap", "--yes", timeout=600)
    assert d.returncode == 0, d.stdout + d.stderr
    st = _wait(lambda: (lambda s: s if s["state"] == "CANCELLED" else None)(world.state("mlab-cap")), 300,
               "CANCELLED")
    assert st["steps_lost"] == 0  # the restart checkpointed first: nothing retrained
    assert not world.job_row("mlab-cap")["restarts_used"]  # planned restarts are not failures
    sbs = lab.status()
    assert len(sbs) == 2 and all(s["timeout"] <= 250 for s in sbs)
    assert all(s["state"] != "timeout" for s in sbs)  # dtrun stopped first: Modal never killed one
    assert all(s["ended_at"] for s in sbs)  # nothing left billing


@pytest.mark.timeout(900)
def test_logs_follow_while_running_then_down_mid_run_is_cancelled_with_a_final_checkpoint(world):
    lab = world.lab()
    r = world.dtrun("up", str(world.job("mlab-down", steps=400)), "--yes", "--detach")
    assert r.returncode == 0, r.stdout + r.stderr
    follow = world.popen("logs", "mlab-down", "-f")
    seen = []

    def trainer_line():
        line = follow.stdout.readline()
        seen.append(line)
        return "[rank0] INFO step" in line

    _wait(trainer_line, 300, "a trainer line through `dtrun logs -f`", every=0)
    (sb,) = lab.status()
    assert sb["state"] == "running"  # shown while it runs, not after
    from orchestrator.contract import runuri

    uri = f"{world.bucket}/runs/mlab-down"
    _wait(lambda: (runuri.latest_committed(uri) or (0,))[0] >= 10, 300, "a committed checkpoint")
    step_at_down = _step(world, "mlab-down")
    d = world.dtrun("down", "mlab-down", timeout=600)
    assert d.returncode == 0, d.stdout + d.stderr
    st = _wait(lambda: (lambda s: s if s["state"] == "CANCELLED" else None)(world.state("mlab-down")), 300,
               "CANCELLED")
    last = runuri.latest_committed(uri)[0]
    assert last >= step_at_down  # the final checkpoint is at or after where `down` found it
    assert last < 400
    (sb,) = lab.status()
    assert sb["state"] != "running" and sb["ended_at"]
    follow.wait(120)
    assert follow.returncode == 0


@pytest.mark.timeout(900)
def test_a_sigkilled_controller_leaves_a_sandbox_that_gc_finds_and_ends(world):
    lab = world.lab()
    r = world.dtrun("up", str(world.job("mlab-gc", steps=400)), "--yes", "--detach")
    assert r.returncode == 0, r.stdout + r.stderr
    _wait(lambda: world.state("mlab-gc")["state"] == "RUNNING", 300, "RUNNING")
    pid = world.state("mlab-gc")["controller_pid"]
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: not Path(f"/proc/{pid}").exists() or
          Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 30, "the controller gone")
    (sb,) = lab.status()
    assert sb["state"] == "running"  # still billing: nobody ends it
    g = world.dtrun("gc", "--yes", timeout=300)
    assert g.returncode == 0, g.stdout + g.stderr
    assert "dtrun-mlab-gc-a1" in g.stdout
    (sb,) = lab.status()
    assert sb["state"] != "running" and sb["ended_at"]


@pytest.mark.timeout(900)
def test_capacity_refused_twice_then_the_third_create_runs(world):
    lab = world.lab(extra=["--refuse-capacity", "2"])
    r = world.dtrun("up", str(world.job("mlab-cap2", steps=20)), "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    st = world.state("mlab-cap2")
    assert st["state"] == "SUCCEEDED", r.stdout
    atts = world.attempts("mlab-cap2")
    assert [a["outcome"] for a in atts] == ["no_capacity", "no_capacity", "succeeded"], atts
    sbs = lab.status()
    assert [s["scheduled"] for s in sbs] == [False, False, True]
    assert [s["state"] for s in sbs][:2] == ["terminated", "terminated"]  # the client ended them
    assert "Insufficient capacity" in r.stdout
