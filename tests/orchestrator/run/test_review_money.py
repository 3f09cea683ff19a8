"""Money-safety regressions found in review: the real controller against the fake cloud on a
virtual clock (the world of ``test_controller_fake``)."""

from __future__ import annotations

import pytest

from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.state import StateStore
from providers.fake import FakeProvider
from test_controller_fake import OFFERS, SimTrainer, make_spec


@pytest.fixture
def world(tmp_path, dtrun_home):
    clock = VirtualClock()
    sim = SimTrainer(steps=1000, step_s=10.0, every=100)
    cloud = FakeProvider(clock=clock, offers=OFFERS, provision_seconds=60, autodown_seconds=None, workload=sim)
    store = StateStore(tmp_path / "state.db")

    def make(spec=None, **kw):
        return Controller(spec or make_spec(tmp_path), store, clock=clock, providers={"fake": cloud}, **kw)

    yield dict(clock=clock, cloud=cloud, store=store, make=make)
    store.close()


def running(cloud):
    return [i for i in cloud.instances() if i.gone_at is None]


def test_budget_guard_still_acts_while_every_poll_fails(world, tmp_path):
    # The provider's status API is down for good: the controller cannot tell the node's state,
    # but the node is billing all the same, so the budget guard must still stop it.
    world["cloud"].inject("poll", "Transient", count=None)
    spec = make_spec(tmp_path, budget={"max_usd": 1.0})  # $1/h → about an hour of a 2.8 h job
    c = world["make"](spec)
    assert c.run() == "OVER_BUDGET"
    assert running(world["cloud"]) == []
    assert world["cloud"].bill()["total_usd"] <= 1.0 + 1.0 * 30 / 3600  # + one tick


def test_instance_created_by_a_failed_launch_is_swept_by_the_running_controller(world):
    # The create call "times out" (Transient) but the cloud made the instance anyway. The same
    # controller keeps running (no restart): it must not leave that instance billing.
    world["cloud"].inject("launch", "Transient", count=1, create=True)
    c = world["make"]()
    assert c.run() == "SUCCEEDED"
    assert [a["outcome"] for a in world["store"].attempts("fakejob")] == ["launch_error", "succeeded"]
    assert running(world["cloud"]) == []
    ghost = [r for r in world["cloud"].bill()["rows"] if r["name"] == "dtrun-fakejob-a1"][0]
    assert ghost["seconds"] <= 2 * 30 + 10  # swept within a tick or two, not at the end of the run
    # and its cost counts against the job (the guard and `dtrun cost` see it)
    assert world["store"].spend_total("fakejob") >= world["cloud"].bill()["total_usd"] - 0.01


@pytest.mark.parametrize("damage", ["garbage", "directory"])
def test_unreadable_state_store_is_one_clear_message_naming_the_file(dtrun_home, damage):
    import subprocess
    import sys

    db = dtrun_home / "state.db"
    if damage == "garbage":
        db.write_text("this is not sqlite\n" * 100)
    else:
        db.mkdir()
    for argv in (["ls"], ["status", "x", "--json"], ["cost"]):
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli", *argv], capture_output=True, text=True,
                           timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 1, out
        assert str(db) in out and "internal error" not in out and "Traceback" not in out, out


def test_store_outage_is_an_oserror_the_controller_catches(monkeypatch):
    # Every run-URI caller (controller tick: lease, progress, DONE; node watchdog) catches OSError;
    # botocore's EndpointConnectionError is not one, so an S3 blip crashed the controller loop.
    import socket

    from orchestrator.contract import runuri

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries of a refused connection: ~20 s otherwise
    for call in (lambda: runuri.write_json("s3://b/run/lease.json", {"expires": 1}),
                 lambda: runuri.read_json("s3://b/run/progress.json")):
        with pytest.raises(OSError, match="s3://b/run/.*EndpointConnectionError"):
            call()


@pytest.mark.parametrize("argv,says", [(["logs"], "Missing argument"), (["up", "x.yaml", "--bogus"], "No such option"),
                                       (["simulate", "x.yaml", "--seed", "abc"], "Invalid value for '--seed'")])
def test_bad_command_line_is_a_usage_error_exit_2(dtrun_home, argv, says):
    # typer >= 0.20 vendors click (typer._click): its UsageError is not click.ClickException,
    # so wrong arguments came out as "internal error ..." with exit 1.
    from orchestrator.cli.app import main

    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    assert code == 2, err.getvalue()
    assert says in err.getvalue() and "internal error" not in err.getvalue()
    assert len(err.getvalue().strip().splitlines()) == 1 and err.getvalue().startswith("dtrun: ")  # one line
    assert "--help" in err.getvalue()


def test_remote_nodes_get_a_bootstrap_command_that_exists_on_the_node(tmp_path):
    # SkyPilot syncs the project to the node's workdir, Modal copies it into the image: this
    # machine's interpreter and absolute repo path do not exist there (every attempt would FAIL,
    # after paying for provisioning). The local provider runs here and keeps them.
    import sys
    from pathlib import Path

    from orchestrator.run.launching import REPO_ROOT
    from orchestrator.plan.spec import parse_spec
    from providers.base import Offer
    from providers.skypilot import build_task_config

    spec = parse_spec({"name": "remote", "resources": {"providers": ["runpod", "modal", "local"], "gpu": "H100",
                                                        "gpus_per_node": 8},
                       "trainer": {"model": "gpt2-124m", "steps": 100, "batch_size": 64, "seq_len": 1024},
                       "checkpoint": {"uri": "s3://bucket/runs/remote"}, "budget": {"max_usd": 500}})
    c = Controller(spec, StateStore(tmp_path / "s.db"), clock=VirtualClock(), providers={})
    for prov in ("runpod", "modal"):
        req = c.launcher.request(1, Offer(prov, "any", "H100", 8, False, 2.89), "x.log", 0.0, None)
        assert req.command == ["python", "infra/node_bootstrap.py"], req.command
        assert (Path(req.workdir) / req.command[1]).is_file()
    run = build_task_config("runpod", c.launcher.request(1, Offer("runpod", "any", "H100", 8, False, 2.89),
                                                        "x.log", 0.0, None))["run"]
    assert str(REPO_ROOT) not in run and sys.executable not in run
    local = c.launcher.request(1, Offer("local", "local", "cpu", 2, False, 0.0), "x.log", 0.0, None)
    assert local.command[0] == sys.executable and Path(local.command[1]).is_file()


def test_up_without_provider_credentials_is_exit_5_before_anything_starts(dtrun_home, tmp_path, monkeypatch):
    # Documented: 5 = a provider refused (missing credentials), nothing rented. It used to start
    # the controller (whose orphan sweep starts SkyPilot's API server) and end FAILED, exit 1.
    from orchestrator.contract.errors import EXIT_PROVIDER, DtrunError
    from orchestrator.cli.up import cmd_up

    monkeypatch.setenv("HOME", str(tmp_path))
    for k in ("RUNPOD_API_KEY", "MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_CONFIG_PATH"):
        monkeypatch.delenv(k, raising=False)
    job = tmp_path / "job.yaml"
    job.write_text("name: rp\nresources: {providers: [runpod], gpu: H100, gpus_per_node: 1, spot: false}\n"
                   "trainer: {model: tiny, steps: 10, batch_size: 8, seq_len: 64}\n"
                   "checkpoint: {uri: 's3://bucket/runs/{name}'}\nbudget: {max_usd: 10}\n")
    with pytest.raises(DtrunError) as ei:
        cmd_up(job, yes=True)
    assert ei.value.exit_code == EXIT_PROVIDER
    # the file SkyPilot reads the key from (it never reads RUNPOD_API_KEY)
    assert "~/.runpod/config.toml" in str(ei.value) and "nothing rented" in str(ei.value)
    assert StateStore().get_job("rp") is None


def test_up_refuses_a_local_disk_run_uri_for_remote_nodes(dtrun_home, tmp_path, monkeypatch):
    # The run URI is the only channel between controller and node: a rented node cannot read
    # job.yaml from (or write checkpoints to) this machine's disk, so the attempt could only fail
    # after provisioning was paid for. Refused before anything starts, naming the field.
    from orchestrator.contract.errors import EXIT_INVALID, DtrunError
    from orchestrator.cli.up import cmd_up

    monkeypatch.setenv("RUNPOD_API_KEY", "rk-test")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".runpod").mkdir()
    (tmp_path / ".runpod" / "config.toml").write_text('[default]\napi_key = "rk-test"\n')
    job = tmp_path / "job.yaml"
    job.write_text("name: rp\nresources: {providers: [runpod], gpu: H100, gpus_per_node: 1, spot: false}\n"
                   "trainer: {model: tiny, steps: 10, batch_size: 8, seq_len: 64}\nbudget: {max_usd: 10}\n")
    with pytest.raises(DtrunError) as ei:
        cmd_up(job, yes=True)
    assert ei.value.exit_code == EXIT_INVALID
    assert "checkpoint.uri" in str(ei.value) and "s3://" in str(ei.value) and "rk-test" not in str(ei.value)
    assert StateStore().get_job("rp") is None


def test_a_group_without_its_subcommand_still_shows_its_help(dtrun_home, capsys):
    from orchestrator.cli.app import main

    assert main(["data"]) == 2
    cap = capsys.readouterr()
    assert "prepare" in cap.out + cap.err and "tokenizer" in cap.out + cap.err
    assert main(["init", "--gpus", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("dtrun: Invalid value for '--gpus': Input should be greater than or equal to 1 "
                           "(see `dtrun init --help`)")
