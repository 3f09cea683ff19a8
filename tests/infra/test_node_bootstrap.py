"""The node bootstrap and its watchdog, with real processes (a torch-free fake trainer) and,
for the exit-code path through torchrun, real torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import node_config, node_network, node_proctree, node_watchdog
from orchestrator.contract import runuri

ROOT = Path(__file__).resolve().parents[2]
BOOT = ROOT / "infra" / "node_bootstrap.py"
FAKE = Path(__file__).resolve().parents[1] / "fakes" / "fake_node_trainer.py"

sys.path.insert(0, str(ROOT / "infra"))
import node_bootstrap as nb  # noqa: E402
import torchrun_launch as tl  # noqa: E402

JOB_YAML = "name: nodetest\ntrainer:\n  steps: 20\n"


def _run_uri(tmp_path: Path) -> str:
    uri = "file://" + str(tmp_path / "run")
    runuri.write_text(runuri.join(uri, "job.yaml"), JOB_YAML)
    return uri


def _env(uri: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTRUN_", "FAKE_", "SKYPILOT_"))}
    env.update({
        "DTRUN_RUN_URI": uri, "DTRUN_JOB": "nodetest", "DTRUN_ATTEMPT": "3",
        "DTRUN_WATCHDOG_SECONDS": "0.1", "DTRUN_STOP_GRACE_SECONDS": "3",
        "DTRUN_KILL_GRACE_SECONDS": "2",
        "DTRUN_TRAINER_CMD": f"{sys.executable} {FAKE}",
        "PYTHONPATH": str(ROOT),
    })
    env.update(extra)
    return env


def _boot(uri: str, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BOOT)], env=_env(uri, **extra), capture_output=True,
                          text=True, timeout=timeout)


def _read(uri: str, name: str):
    return runuri.read_json(runuri.join(uri, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


# ---- environment → torchrun flags -----------------------------------------------------------

def test_single_node_is_standalone_with_gpu_count_fallbacks():
    cfg = node_config.NodeConfig.from_env({"DTRUN_RUN_URI": "s3://b/r", "DTRUN_JOB": "j", "RUNPOD_GPU_COUNT": "4"})
    assert cfg.nproc_per_node == 4 and cfg.nnodes == 1
    assert node_network.torchrun_flags(cfg) == ["--standalone", "--nproc-per-node", "4", "--shutdown-timeout", "40"]
    argv = nb.trainer_argv(cfg, "/tmp/job.yaml")
    assert argv[2:] == ["--standalone", "--nproc-per-node", "4", "--shutdown-timeout", "40", "-m", "trainer",
                        "--job", "/tmp/job.yaml", "--run-uri", "s3://b/r"]
    assert argv[1].endswith("torchrun_launch.py")
    cfg = node_config.NodeConfig.from_env({"DTRUN_RUN_URI": "u", "DTRUN_JOB": "j", "GPU_COUNT": "2",
                                  "DTRUN_NPROC_PER_NODE": "3"})
    assert cfg.nproc_per_node == 3
    assert node_config.NodeConfig.from_env({"DTRUN_RUN_URI": "u", "DTRUN_JOB": "j"}).nproc_per_node == 1
    # The workers' grace after a forwarded SIGTERM follows the watchdog's kill grace.
    cfg = node_config.NodeConfig.from_env({"DTRUN_RUN_URI": "u", "DTRUN_JOB": "j", "DTRUN_KILL_GRACE_SECONDS": "300"})
    assert node_network.torchrun_flags(cfg)[-2:] == ["--shutdown-timeout", "300"]


def test_skypilot_multi_node_maps_to_static_rendezvous():
    env = {"DTRUN_RUN_URI": "s3://b/r", "DTRUN_JOB": "j", "SKYPILOT_NODE_RANK": "1",
           "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NUM_GPUS_PER_NODE": "8",
           "DTRUN_MASTER_PORT": "29600"}
    cfg = node_config.NodeConfig.from_env(env)
    assert node_network.torchrun_flags(cfg) == ["--nproc-per-node", "8", "--shutdown-timeout", "40", "--nnodes", "2", "--node-rank", "1",
                                      "--master-addr", "10.0.0.5", "--master-port", "29600"]


@pytest.mark.parametrize("env, msg", [
    ({"DTRUN_JOB": "j"}, "DTRUN_RUN_URI"),
    ({"DTRUN_RUN_URI": "u"}, "DTRUN_JOB"),
    ({"DTRUN_RUN_URI": "u", "DTRUN_JOB": "j", "DTRUN_PRICE_PER_HOUR": "cheap"}, "DTRUN_PRICE_PER_HOUR"),
    ({"DTRUN_RUN_URI": "u", "DTRUN_JOB": "j", "DTRUN_NNODES": "2"}, "master address"),
])
def test_bad_environment_is_named(env, msg):
    with pytest.raises(node_config.ConfigError, match=msg):
        node_config.NodeConfig.from_env(env)


def test_exit_code_pick():
    assert tl.pick_exit_code([1, 2, 75]) == 2
    assert tl.pick_exit_code([-15, 75]) == 75
    assert tl.pick_exit_code([-9]) == 137
    assert tl.pick_exit_code([3, 1]) == 3


# ---- watchdog decisions on a moved clock ------------------------------------------------------

def _wd(tmp_path, **kw):
    uri = _run_uri(tmp_path)
    cfg = node_config.NodeConfig(run_uri=uri, job="nodetest", check_seconds=10, stop_grace_seconds=60,
                        kill_grace_seconds=30, **kw)
    return uri, node_watchdog.Watchdog(cfg, start=1000.0)


def test_watchdog_budget_fires_before_the_next_check_would_cross(tmp_path):
    # $36/h = $0.01/s; budget $10 → 1000 s; look-ahead = 10 s check + 60 s STOP grace + 30 s kill grace
    _, wd = _wd(tmp_path, price_per_hour=36.0, budget_left_usd=10.0)
    assert wd.check(1000 + 899) is None
    reason, detail = wd.check(1000 + 901)
    assert reason == "budget" and "$10" in detail


def test_watchdog_counts_provisioning_from_launch_time(tmp_path):
    _, wd = _wd(tmp_path, price_per_hour=36.0, budget_left_usd=10.0, launched_at=500.0)
    assert wd.check(1000 + 399) is None
    assert wd.check(1000 + 401)[0] == "budget"


def test_watchdog_deadline_two_intervals_plus_graces(tmp_path):
    _, wd = _wd(tmp_path, deadline=2000.0)
    assert wd.check(2000 - 111) is None
    assert wd.check(2000 - 109)[0] == "deadline"


def test_watchdog_restart_before_the_providers_timeout(tmp_path):
    # Modal: the node gets 24 h (DTRUN_NODE_TIMEOUT_SECONDS from its start); the watchdog's deadline
    # is the earlier of the job's deadline and that timeout less the restart grace.
    _, wd = _wd(tmp_path, node_timeout_seconds=86400.0, restart_grace_seconds=1200.0)
    end = 1000 + 86400 - 1200  # start + timeout - grace
    assert wd.check(end - 111) is None
    reason, detail = wd.check(end - 109)
    assert reason == "restart" and "planned restart" in detail
    # the job's deadline comes first: that is a deadline stop, not a restart
    _, wd = _wd(tmp_path, node_timeout_seconds=86400.0, restart_grace_seconds=1200.0, deadline=50_000.0)
    assert wd.check(50_000 - 109)[0] == "deadline"
    _, wd = _wd(tmp_path, node_timeout_seconds=86400.0, restart_grace_seconds=1200.0, deadline=end + 60)
    assert wd.check(end - 109)[0] == "restart"  # the deadline is past the restart point: restart first
    cfg = node_config.NodeConfig.from_env({"DTRUN_RUN_URI": "file:///x", "DTRUN_JOB": "j",
                                  "DTRUN_NODE_TIMEOUT_SECONDS": "86400", "DTRUN_RESTART_GRACE_SECONDS": "900"})
    assert (cfg.node_timeout_seconds, cfg.restart_grace_seconds) == (86400.0, 900.0)


def test_restart_stop_checkpoints_and_exits_resume_me(tmp_path):
    uri = _run_uri(tmp_path)
    r = _boot(uri, FAKE_STEPS="400", DTRUN_NODE_TIMEOUT_SECONDS="12", DTRUN_RESTART_GRACE_SECONDS="4")
    assert r.returncode == nb.EXIT_WATCHDOG, r.stderr
    assert _read(uri, "watchdog.json")["reason"] == "restart"


def test_watchdog_lease_off_by_default_and_stale_when_set(tmp_path):
    uri, wd = _wd(tmp_path)
    runuri.write_json(runuri.join(uri, runuri.LEASE), {"expires": 1000.0, "renewed": 985.0, "controller": "x"})
    assert wd.check(1_000_000) is None  # controller_lost_minutes unset: a stale lease changes nothing
    uri, wd = _wd(tmp_path, controller_lost_minutes=2)
    runuri.write_json(runuri.join(uri, runuri.LEASE), {"expires": 1000.0, "renewed": 985.0, "controller": "x"})
    assert wd.check(1000 + 119) is None
    assert wd.check(1000 + 121)[0] == "controller_lost"
    runuri.write_json(runuri.join(uri, runuri.LEASE), {"expires": 1200.0, "renewed": 1185.0, "controller": "x"})
    assert wd.check(1000 + 121) is None  # renewed


def test_watchdog_idle_tracks_step_not_heartbeat(tmp_path):
    uri, wd = _wd(tmp_path, idle_minutes=1)
    prog = runuri.join(uri, runuri.PROGRESS)
    runuri.write_json(prog, {"step": 5, "attempt": 1, "time": 1000})
    assert wd.check(1030) is None
    runuri.write_json(prog, {"step": 6, "attempt": 1, "time": 1040})
    assert wd.check(1050) is None
    runuri.write_json(prog, {"step": 6, "attempt": 1, "time": 1100})  # heartbeat, same step
    assert wd.check(1100) is None
    assert wd.check(1111)[0] == "idle"


# ---- real processes -------------------------------------------------------------------------

def test_trainer_finishes_and_exit_code_passes_through(tmp_path):
    uri = _run_uri(tmp_path)
    r = _boot(uri, DTRUN_PRICE_PER_HOUR="1", DTRUN_BUDGET_LEFT_USD="100", DTRUN_IDLE_MINUTES="5")
    assert r.returncode == 0, r.stderr
    assert _read(uri, "DONE")["step"] == 20
    assert _read(uri, runuri.PROGRESS)["attempt"] == 3
    assert _read(uri, "watchdog.json") is None and not runuri.exists(runuri.join(uri, "STOP"))
    r = _boot(_run_uri(tmp_path / "b"), FAKE_MODE="exit=3")
    assert r.returncode == 3


def test_missing_job_yaml_is_bad_config(tmp_path):
    r = _boot("file://" + str(tmp_path / "nothing"))
    assert r.returncode == runuri.EXIT_BAD_CONFIG
    assert "job.yaml" in r.stderr


def test_budget_stop_checkpoints_and_exits_76(tmp_path):
    uri = _run_uri(tmp_path)
    # $3600/h = $1/s; $7.5 left, look-ahead 0.1 s check + 3 s + 2 s graces → STOP after ~2.4 s of a ~10 s run.
    r = _boot(uri, FAKE_STEPS="200", DTRUN_PRICE_PER_HOUR="3600", DTRUN_BUDGET_LEFT_USD="7.5")
    assert r.returncode == nb.EXIT_WATCHDOG, r.stderr
    wd = _read(uri, "watchdog.json")
    assert wd["reason"] == "budget" and wd["attempt"] == 3 and wd["spend_usd"] < 7.5
    assert runuri.exists(runuri.join(uri, "STOP"))
    last = runuri.latest_committed(uri)
    assert last is not None and 0 < last[0] < 200
    assert _read(uri, "DONE") is None


def test_controller_lost_stops_soon_after_lease_goes_stale(tmp_path):
    uri = _run_uri(tmp_path)
    runuri.write_json(runuri.join(uri, runuri.LEASE),
                      {"expires": time.time() + 0.5, "renewed": time.time(), "controller": "gone"})
    t0 = time.time()
    r = _boot(uri, FAKE_STEPS="400", DTRUN_CONTROLLER_LOST_MINUTES=str(1 / 60))  # 1 s
    assert r.returncode == nb.EXIT_WATCHDOG, r.stderr
    assert _read(uri, "watchdog.json")["reason"] == "controller_lost"
    assert time.time() - t0 < 12
    assert runuri.latest_committed(uri) is not None


def test_deadline_stop(tmp_path):
    uri = _run_uri(tmp_path)
    r = _boot(uri, FAKE_STEPS="400", DTRUN_DEADLINE=str(time.time() + 7.5))
    assert r.returncode == nb.EXIT_WATCHDOG, r.stderr
    assert _read(uri, "watchdog.json")["reason"] == "deadline"


def test_idle_trainer_that_ignores_stop_is_terminated(tmp_path):
    uri = _run_uri(tmp_path)
    # hang: no progress and ignores STOP → after the grace SIGTERM → emergency checkpoint, 75 → 76
    r = _boot(uri, FAKE_MODE="hang", DTRUN_IDLE_MINUTES=str(0.5 / 60), DTRUN_STOP_GRACE_SECONDS="1")
    assert r.returncode == nb.EXIT_WATCHDOG, r.stderr
    assert _read(uri, "watchdog.json")["reason"] == "idle"
    assert "SIGTERM" in r.stderr and "SIGKILL" not in r.stderr


def test_stubborn_trainer_is_killed_with_everything_it_started(tmp_path):
    uri = _run_uri(tmp_path)
    r = _boot(uri, FAKE_MODE="stubborn", DTRUN_PRICE_PER_HOUR="3600", DTRUN_BUDGET_LEFT_USD="2",
              DTRUN_STOP_GRACE_SECONDS="0.5", DTRUN_KILL_GRACE_SECONDS="0.5")
    assert r.returncode == nb.EXIT_WATCHDOG, r.stderr
    assert "SIGKILL" in r.stderr


def test_grandchild_in_its_own_session_is_cleaned_up(tmp_path):
    uri = _run_uri(tmp_path)
    r = _boot(uri, FAKE_MODE="spawn", FAKE_STEPS="10")
    assert r.returncode == 0, r.stderr
    pid = int(runuri.read_text(runuri.join(uri, "grandchild.pid")))
    deadline = time.time() + 5
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "a process the trainer started outlived the node"


def test_sigterm_is_forwarded_and_becomes_exit_75(tmp_path):
    uri = _run_uri(tmp_path)
    p = subprocess.Popen([sys.executable, str(BOOT)], env=_env(uri, FAKE_STEPS="1000"),
                         stderr=subprocess.PIPE, text=True)
    prog = runuri.join(uri, runuri.PROGRESS)
    deadline = time.time() + 20
    while runuri.read_json(prog) is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert p.returncode == runuri.EXIT_PREEMPTED, err
    step = runuri.latest_committed(uri)[0]
    assert 0 < step < 1000
    assert _read(uri, "watchdog.json") is None


def test_sigkilled_bootstrap_takes_the_trainer_with_it(tmp_path):
    uri = _run_uri(tmp_path)
    p = subprocess.Popen([sys.executable, str(BOOT)], env=_env(uri, FAKE_STEPS="100000", FAKE_MODE="spawn"),
                         stderr=subprocess.DEVNULL, start_new_session=True)
    gpid = runuri.join(uri, "grandchild.pid")
    deadline = time.time() + 20
    while runuri.read_text(gpid) is None and time.time() < deadline:
        time.sleep(0.05)
    kids = node_proctree.descendants(p.pid)
    assert kids
    os.killpg(p.pid, signal.SIGKILL)  # what the local provider does to a "preempted" node
    p.wait(timeout=10)
    deadline = time.time() + 5
    while any(_alive(k) for k in kids) and time.time() < deadline:
        time.sleep(0.05)
    # the trainer (own group, PDEATHSIG) dies with the bootstrap. Its own session-leader grandchild
    # is out of reach once every ancestor is gone — real torchrun workers get PDEATHSIG from
    # torchrun_launch, tested below.
    trainer_pid = kids[0] if kids else None
    assert trainer_pid is not None and not _alive(trainer_pid)
    gp = int(runuri.read_text(gpid))
    if _alive(gp):
        os.kill(gp, signal.SIGKILL)


def test_self_terminate_runs_after_the_trainer(tmp_path):
    uri = _run_uri(tmp_path)
    marker = tmp_path / "terminated"
    r = _boot(uri, FAKE_STEPS="3", DTRUN_SELF_TERMINATE=f"echo bye > {marker}")
    assert r.returncode == 0, r.stderr
    assert marker.read_text().strip() == "bye"


def test_job_yaml_from_s3(s3_bucket):
    uri = f"{s3_bucket}/runs/nodetest"
    runuri.write_text(runuri.join(uri, "job.yaml"), JOB_YAML)
    r = _boot(uri, FAKE_STEPS="3", FAKE_STEP_SECONDS="0.01", DTRUN_IDLE_MINUTES="5")
    assert r.returncode == 0, r.stderr
    assert _read(uri, "DONE")["step"] == 3


# ---- real torchrun (workers are the fake trainer module) -------------------------------------

@pytest.mark.slow
def test_real_torchrun_passes_75_through_and_kills_workers_with_it(tmp_path):
    uri = _run_uri(tmp_path)
    env = _env(uri, FAKE_STEPS="100000", FAKE_STEP_SECONDS="0.05", DTRUN_NPROC_PER_NODE="2",
               DTRUN_TRAINER_MODULE="fake_node_trainer",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(FAKE.parent)]))
    env.pop("DTRUN_TRAINER_CMD")
    p = subprocess.Popen([sys.executable, str(BOOT)], env=env, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    prog = runuri.join(uri, runuri.PROGRESS)
    deadline = time.time() + 60
    while runuri.read_json(prog) is None and time.time() < deadline:
        time.sleep(0.1)
    assert _read(uri, runuri.PROGRESS)["world_size"] == 2
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == runuri.EXIT_PREEMPTED, err
    assert runuri.latest_committed(uri) is not None


@pytest.mark.slow
def test_real_torchrun_bad_config_exit_2_passes_through(tmp_path):
    uri = _run_uri(tmp_path)
    env = _env(uri, FAKE_MODE="exit=2", DTRUN_NPROC_PER_NODE="2", DTRUN_TRAINER_MODULE="fake_node_trainer",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(FAKE.parent)]))
    env.pop("DTRUN_TRAINER_CMD")
    r = subprocess.run([sys.executable, str(BOOT)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == runuri.EXIT_BAD_CONFIG, r.stderr


@pytest.mark.slow
def test_real_torchrun_workers_die_when_the_node_is_sigkilled(tmp_path):
    uri = _run_uri(tmp_path)
    env = _env(uri, FAKE_STEPS="100000", DTRUN_NPROC_PER_NODE="2", DTRUN_TRAINER_MODULE="fake_node_trainer",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(FAKE.parent)]))
    env.pop("DTRUN_TRAINER_CMD")
    p = subprocess.Popen([sys.executable, str(BOOT)], env=env, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    prog = runuri.join(uri, runuri.PROGRESS)
    deadline = time.time() + 60
    while runuri.read_json(prog) is None and time.time() < deadline:
        time.sleep(0.1)
    tree = node_proctree.descendants(p.pid)
    assert len(tree) >= 3  # launcher + 2 workers
    os.killpg(p.pid, signal.SIGKILL)  # the bootstrap's group only: torchrun and workers are elsewhere
    p.wait(timeout=10)
    deadline = time.time() + 10
    while any(_alive(k) for k in tree) and time.time() < deadline:
        time.sleep(0.05)
    left = [k for k in tree if _alive(k)]
    for k in left:
        os.kill(k, signal.SIGKILL)
    assert not left, "torchrun or its workers outlived a SIGKILLed node"


# ---- the node's report: record and output in the run URI -----------------------------------

def test_node_reports_its_rank_ip_state_and_output(tmp_path):
    """Node 1 of 2 (SkyPilot's env): its record says rank 1, the IP SkyPilot gave that rank,
    RUNNING while it trains and EXITED 0 at the end; its log holds the trainer's output and the
    bootstrap's own lines, which also still reach the node's stdout/stderr."""
    uri = _run_uri(tmp_path)
    seen: list[dict] = []
    env = _env(uri, SKYPILOT_NODE_RANK="1", SKYPILOT_NODE_IPS="10.9.0.2\n10.9.0.3\n", SKYPILOT_NUM_GPUS_PER_NODE="2",
               DTRUN_NODE_REPORT_SECONDS="0.1", FAKE_STEPS="40", FAKE_STEP_SECONDS="0.05")
    p = subprocess.Popen([sys.executable, str(BOOT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.time() + 60
        while p.poll() is None and time.time() < end:
            rec = runuri.read_json(runuri.node_uri(uri, 3, 1))
            if rec:
                seen.append(rec)
            time.sleep(0.05)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-2000:]
    assert "RUNNING" in {r["state"] for r in seen}
    recs = runuri.node_records(uri, 3)
    assert len(recs) == 1
    rec = recs[0]
    assert (rec["rank"], rec["nnodes"], rec["ip"], rec["state"], rec["exit_code"]) == (1, 2, "10.9.0.3", "EXITED", 0)
    assert rec["master"] == "10.9.0.2:29500" and rec["host"]
    text = runuri.read_text(runuri.node_uri(uri, 3, 1, "log"))
    assert "[dtrun-node" in text and "trainer exited 0" in text
    assert "node 1/2" in text and "node 1/2" in err  # passed through as well as recorded


# ---- multi-node networking ---------------------------------------------------------------------

def _multi(**extra):
    env = {"DTRUN_RUN_URI": "s3://b/r", "DTRUN_JOB": "j", "SKYPILOT_NODE_RANK": "1",
           "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NUM_GPUS_PER_NODE": "8", **extra}
    return node_config.NodeConfig.from_env(env), env


IFACES = {"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "ens5": ["10.0.0.6", "10.0.9.9"]}


def test_socket_ifname_is_the_interface_of_the_nodes_private_ip():
    cfg, env = _multi()
    ip = node_network.node_ip(env, cfg.node_rank, cfg.master_addr)
    assert ip == "10.0.0.6"
    assert node_network.network_env(cfg, env, ip, interfaces=lambda: IFACES) == {"GLOO_SOCKET_IFNAME": "ens5",
                                                                      "NCCL_SOCKET_IFNAME": "ens5"}
    # the environment's own choice wins; one node, or every node on this host, needs none
    assert node_network.network_env(cfg, {**env, "NCCL_SOCKET_IFNAME": "ib0"}, ip, interfaces=lambda: IFACES) == {
        "GLOO_SOCKET_IFNAME": "ens5"}
    one = node_config.NodeConfig.from_env({"DTRUN_RUN_URI": "u", "DTRUN_JOB": "j"})
    assert node_network.network_env(one, {}, None, interfaces=lambda: IFACES) == {}
    # an IP on none of the interfaces (a public IP behind NAT): gloo/NCCL choose, as before
    assert node_network.network_env(cfg, env, "203.0.113.7", interfaces=lambda: IFACES) == {}
    local, lenv = _multi(SKYPILOT_NODE_IPS="", DTRUN_NNODES="2", DTRUN_MASTER_ADDR="127.0.0.1")
    assert node_network.network_env(local, lenv, "127.0.0.1", interfaces=lambda: IFACES) == {}


def test_real_interfaces_name_loopback():
    assert "127.0.0.1" in node_network.ipv4_by_interface().get("lo", [])


@pytest.mark.parametrize("extra, ip, resolved, msg", [
    ({"DTRUN_MASTER_ADDR": "head-node"}, "10.0.0.6", ["127.0.1.1"], "'head-node' resolves to loopback"),
    ({"SKYPILOT_NODE_IPS": "", "DTRUN_NNODES": "2", "DTRUN_MASTER_ADDR": "10.0.0.5"}, "127.0.1.1", [],
     "address is 127.0.1.1 .* gloo would listen on loopback"),
])
def test_unreachable_rendezvous_is_refused(extra, ip, resolved, msg):
    cfg, env = _multi(**extra)
    with pytest.raises(node_config.ConfigError, match=msg):
        node_network.network_env(cfg, env, ip, interfaces=lambda: IFACES, resolve=lambda h: resolved)


# ---- node setup on a GPU node (issue 25) ---------------------------------------------------------

def test_node_setup_replaces_a_cpu_torch_on_a_gpu_node():
    from infra import node_setup as ns

    assert ns.torch_matches("2.13.0+cpu", "2.13.0") is True  # a CPU node: fine
    assert ns.torch_matches("2.13.0+cpu", "2.13.0", gpu_node=True) is False
    assert ns.torch_matches("2.13.0+cu128", "2.13.0", gpu_node=True) is True
    assert ns.torch_matches("2.13.0", "2.13.0", gpu_node=True) is True  # PyPI's default wheel is CUDA


def test_node_setup_checks_the_builds_cuda_against_the_driver():
    from infra import node_setup as ns

    assert ns.driver_problem("12.8", "550.54.15") is None
    assert ns.driver_problem("13.0", "580.65.06") is None
    assert "needs NVIDIA driver ≥ 580.65.06" in ns.driver_problem("13.0", "570.124.06")
    assert "CPU-only build" in ns.driver_problem(None, "550.54.15")
    assert ns.driver_problem("13.0", None) is None  # no GPU: nothing to check


def test_the_node_side_never_imports_torch():
    """The bootstrap and every module it runs (the watchdog, the process tree, a command job's
    sync) load without torch, so the watchdog stays light whatever the trainer does. Transitive:
    what each module imports, and what those import."""
    mods = ["infra.node_bootstrap", "infra.node_config", "infra.node_log", "infra.node_network",
            "infra.node_proctree", "infra.node_watchdog", "infra.node_report", "infra.usercode",
            "infra.usercode_formats", "infra.usercode_sync", "infra.usercode_progress"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'pydantic'))\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
