"""The first hour of a new user (issue 23): prices before any account, refusals before renting,
run URIs that follow the job file, `dtrun init`, `--version`, `down --yes`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.app import main

ROOT = Path(__file__).resolve().parents[3]
GPT2 = ROOT / "jobs" / "gpt2-124m.yaml"


def _json(capsys, argv):
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


# ---- 1. prices before an account ---------------------------------------------------------------

def test_dry_run_without_any_account_prices_every_offer_and_exits_5(no_credentials, capsys):
    rc, out = _json(capsys, ["up", str(GPT2), "--dry-run", "--json"])
    assert rc == 5 and out["exit_code"] == 5
    assert out["usable"] is False and out["chosen"] is None
    offers = out["offers"]
    assert {o["provider"] for o in offers} == {"runpod", "lambda", "vast", "modal"}
    assert all(o["usable"] is False and o["fix"] for o in offers)
    # ranked as the rentable ones would be (known prices first, then by expected cost)
    costs = [(not o.get("price_known", True), o["expected_usd"]) for o in offers]
    assert costs == sorted(costs)
    # the estimate and the budget verdict are there, for the offer it would choose
    assert out["would_choose"]["provider"] == offers[0]["provider"]
    assert out["cost_usd"] == pytest.approx(offers[0]["cost_usd"]) and out["cost_usd"] > 0
    assert out["budget_usd"] == 250 and out["within_budget"] is True
    # each fix names the credential file and the command that writes it
    fixes = {o["provider"]: o["fix"] for o in offers}
    assert "~/.runpod/config.toml" in fixes["runpod"] and "runpod config" in fixes["runpod"]
    assert "~/.config/vastai/vast_api_key" in fixes["vast"] and "vastai set api-key" in fixes["vast"]
    assert "~/.lambda_cloud/lambda_keys" in fixes["lambda"]
    assert "~/.modal.toml" in fixes["modal"] and "modal token set" in fixes["modal"]


def test_dry_run_without_any_account_human_output(no_credentials, capsys):
    rc = main(["up", str(GPT2), "--dry-run"])
    cap = capsys.readouterr()
    assert rc == 5
    assert "not offered" not in cap.out
    assert "Would choose" in cap.out and "total" in cap.out and "Budget:" in cap.out
    assert "* needs credentials: runpod" in cap.out and "runpod*" in cap.out
    assert "once its credentials are set" in cap.err and "dtrun simulate" in cap.err
    assert "(nothing rented; exit 5)" in cap.err


def test_without_an_account_a_plan_that_does_not_fit_names_exit_4_only(no_credentials, capsys, tmp_path):
    f = tmp_path / "big.yaml"
    assert main(["init", "--model", "llama3-70b", "--gpu", "T4", "--out", str(f)]) == 0
    capsys.readouterr()
    assert main(["up", str(f), "--dry-run"]) == 4
    err = " ".join(capsys.readouterr().err.split())
    assert "Refused (exit 4)" in err and "exit 5" not in err and "once its credentials are set" in err


def test_some_usable_are_ranked_first_the_others_need_credentials(no_credentials, capsys, monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-placeholder")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-placeholder")
    # the job's run URI is on S3: a Modal node needs the bucket's keys too (else exit 5)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAPLACEHOLDER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "placeholder")
    rc, out = _json(capsys, ["up", str(GPT2), "--dry-run", "--json"])
    assert rc == 0 and out["usable"] is True and out["chosen"]["provider"] == "modal"
    usable = [o["usable"] for o in out["offers"]]
    assert usable[0] is True and usable == sorted(usable, reverse=True) and False in usable
    assert out["would_choose"] is None
    main(["up", str(GPT2), "--dry-run"])
    text = capsys.readouterr().out
    assert "Chosen:" in text and "vast*" in text and "* needs credentials: vast" in text


# ---- 3. refused before renting, never after --------------------------------------------------

def _job(folder: Path, name: str = "first", providers=("local",), gpu: str = "cpu", **trainer) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    uri = trainer.pop("uri", None)
    spec = {"name": name, "resources": {"providers": list(providers), "gpu": gpu, "gpus_per_node": 1},
            "trainer": {"model": "tiny", "steps": 5, "batch_size": 8, "seq_len": 64, **trainer},
            "budget": {"max_usd": 100}}
    if uri is not None:
        spec["checkpoint"] = {"uri": uri}
    f = folder / "job.yaml"
    f.write_text(yaml.safe_dump(spec))
    return f


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    """Neither the environment nor boto3's chain has AWS credentials."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
              "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
              "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _refused(capsys, argv, *needles) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 6, err
    assert "internal error" not in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("bad,meant", [("s3:/my-bucket/runs", "s3://my-bucket/runs"),
                                       ("s3//my-bucket/runs", "s3://my-bucket/runs")])
@pytest.mark.parametrize("provider,gpu", [("local", "cpu"), ("runpod", "H100"), ("lambda", "H100"),
                                          ("vast", "H100"), ("modal", "H100")])
def test_a_malformed_uri_is_refused_on_every_provider(tmp_path, capsys, dtrun_home, provider_credentials,
                                                      bad, meant, provider, gpu):
    f = _job(tmp_path / "a", providers=(provider,), gpu=gpu, uri=bad)
    _refused(capsys, ["up", str(f), "--dry-run"], "checkpoint.uri", repr(meant), "nothing rented")
    f = _job(tmp_path / "b", providers=(provider,), gpu=gpu, data=bad.replace("runs", "shards"))
    _refused(capsys, ["up", str(f), "--dry-run"], "trainer.data", repr(meant.replace("runs", "shards")))
    assert not (tmp_path / "a" / "s3:").exists() and not any(Path.cwd().glob("s3:*"))


def test_a_malformed_local_run_uri_never_becomes_a_folder(tmp_path, capsys, dtrun_home, monkeypatch):
    monkeypatch.chdir(tmp_path)
    f = _job(tmp_path, uri="s3:/my-bucket/runs/{name}")
    _refused(capsys, ["up", str(f), "--yes"], "checkpoint.uri", "'s3://my-bucket/runs/first'")
    assert not (tmp_path / "s3:").exists()
    from orchestrator.run.state import StateStore

    assert StateStore().get_job("first") is None


def test_a_scheme_without_its_package_names_the_package(tmp_path, capsys, dtrun_home, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    # gcsfs absent whatever this machine has installed (the test never skips)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else real(name, *a))
    f = _job(tmp_path, uri="gs://my-bucket/runs/{name}")
    _refused(capsys, ["up", str(f), "--dry-run"], "checkpoint.uri", "gcsfs", "pip install gcsfs")
    _refused(capsys, ["up", str(f), "--yes"], "gcsfs")
    f = _job(tmp_path / "other", uri="ftp://host/runs")
    _refused(capsys, ["up", str(f), "--dry-run"], "checkpoint.uri", "ftp://")


def test_s3_without_credentials_is_exit_6_naming_what_to_set(tmp_path, capsys, dtrun_home, no_aws):
    f = _job(tmp_path, uri="s3://my-bucket/runs/{name}")
    _refused(capsys, ["up", str(f), "--yes"], "checkpoint.uri", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
             "nothing rented")
    from orchestrator.run.state import StateStore

    assert StateStore().get_job("first") is None


def test_an_unwritable_local_run_uri_is_refused_and_no_job_is_left_pending(tmp_path, capsys, dtrun_home):
    (tmp_path / "a-file").write_text("not a folder")
    f = _job(tmp_path, uri=str(tmp_path / "a-file" / "runs" / "{name}"))
    _refused(capsys, ["up", str(f), "--dry-run"], "checkpoint.uri", "a-file is a file")
    _refused(capsys, ["up", str(f), "--yes"], "checkpoint.uri", "cannot be written")
    assert main(["ls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["jobs"] == []


def test_data_without_shards_is_refused_before_renting(tmp_path, capsys, dtrun_home):
    (tmp_path / "empty").mkdir()
    f = _job(tmp_path, data="./empty")
    _refused(capsys, ["up", str(f), "--dry-run"], "trainer.data", "no .bin or .npy token shards", "dtrun data prepare")
    _refused(capsys, ["up", str(f), "--yes"], "trainer.data")
    (tmp_path / "vals").mkdir()
    (tmp_path / "vals" / "val_000000.bin").write_bytes(b"\0" * 16)
    f = _job(tmp_path, data="./vals")
    _refused(capsys, ["up", str(f), "--dry-run"], "trainer.data", "only validation shards")
    f = _job(tmp_path, data="./missing")
    _refused(capsys, ["up", str(f), "--dry-run"], "trainer.data", "does not exist")


def test_s3_data_without_shards_is_refused_by_up(tmp_path, capsys, dtrun_home, s3_bucket):
    import boto3

    boto3.client("s3").put_object(Bucket=s3_bucket[5:], Key="data/manifest.json", Body=b'{"vocab_size": 256}')
    f = _job(tmp_path, uri=str(tmp_path / "runs" / "{name}"), data=f"{s3_bucket}/data/")
    assert main(["up", str(f), "--dry-run"]) == 0  # no network in the dry run
    capsys.readouterr()
    _refused(capsys, ["up", str(f), "--yes"], "trainer.data", "no .bin or .npy token shards")


def test_s3_run_uri_probe_names_a_missing_bucket(tmp_path, capsys, dtrun_home, s3_server):
    f = _job(tmp_path, uri="s3://no-such-bucket-dtrun/runs/{name}")
    _refused(capsys, ["up", str(f), "--yes"], "checkpoint.uri", "no-such-bucket-dtrun")


# ---- 4. relative run URIs follow the job file ----------------------------------------------------

def test_a_relative_run_uri_resolves_against_the_job_files_folder(tmp_path, capsys, monkeypatch, dtrun_home):
    f = _job(tmp_path / "project", uri="./runs/{name}")
    outs = []
    for cwd in (tmp_path, tmp_path / "project"):
        monkeypatch.chdir(cwd)
        rc, out = _json(capsys, ["up", str(f), "--dry-run", "--json"])
        assert rc == 0
        outs.append(out["run_uri"])
    assert outs[0] == outs[1] == f"file://{tmp_path / 'project' / 'runs' / 'first'}"


def test_the_shipped_quickstart_trains_into_the_repos_runs_folder(capsys, monkeypatch, tmp_path, dtrun_home):
    monkeypatch.chdir(tmp_path)
    rc, out = _json(capsys, ["up", str(ROOT / "jobs" / "quickstart.yaml"), "--dry-run", "--json"])
    assert rc == 0 and out["run_uri"] == f"file://{ROOT / 'runs' / 'quickstart'}"


def test_a_job_recorded_with_another_run_uri_is_refused_naming_both(tmp_path, capsys, dtrun_home, monkeypatch):
    import orchestrator.cli.up as up
    from orchestrator.run.state import StateStore

    rented = []
    monkeypatch.setattr(up, "run_foreground", lambda spec, plan, store, path, js: rented.append(spec.run_uri) or 0)
    f = _job(tmp_path / "project", uri="./runs/{name}")
    old = f"file://{tmp_path / 'elsewhere' / 'runs' / 'first'}"
    store = StateStore()
    store.create_job("first", "name: first\n", old)
    store.set_state("first", "FAILED", "an earlier session")
    rc = main(["up", str(f), "--yes"])
    err = capsys.readouterr().err
    assert rc == 2 and old in err and str(tmp_path / "project" / "runs" / "first") in err
    assert "--new-run-uri" in err and rented == []
    assert main(["up", str(f), "--yes", "--new-run-uri"]) == 0
    assert rented == [f"file://{tmp_path / 'project' / 'runs' / 'first'}"]
    # a recorded run still going is never moved, flag or not
    store.set_state("first", "RUNNING")
    store.update_job("first", run_uri=old)
    assert main(["up", str(f), "--yes", "--new-run-uri"]) == 2
    assert "dtrun down first" in capsys.readouterr().err and len(rented) == 1


# ---- 5. dtrun init, --version, down --yes ------------------------------------------------------

def test_init_without_a_terminal_writes_defaults_that_pass_the_dry_run(tmp_path, capsys, monkeypatch, dtrun_home):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO(""))
    assert main(["init"]) == 0
    text = (tmp_path / "job.yaml").read_text()
    assert text.count("#") >= 12 and "dtrun up job.yaml --dry-run" in text  # commented
    capsys.readouterr()
    assert main(["up", "job.yaml", "--dry-run"]) == 0


def test_init_for_a_gpu_passes_the_dry_run(tmp_path, capsys, provider_credentials, monkeypatch, dtrun_home):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    out = tmp_path / "exp" / "gpt.yaml"
    assert main(["init", "--model", "gpt2-124m", "--gpu", "H100", "--budget", "40", "--out", str(out)]) == 0
    capsys.readouterr()
    rc, rep = _json(capsys, ["up", str(out), "--dry-run", "--json"])
    assert rc == 0 and rep["budget_usd"] == 40 and rep["chosen"]["gpu"].startswith("H100")


def test_init_splits_the_batch_over_any_rank_count_and_refuses_a_data_uri_that_cannot_work(
        tmp_path, capsys, monkeypatch, dtrun_home):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "--gpus", "3", "--out", "three.yaml"]) == 0  # batch 8 over 3 ranks: none fitted
    capsys.readouterr()
    assert main(["up", "three.yaml", "--dry-run"]) == 0
    capsys.readouterr()
    for data, why in (("s3:/bucket/x", "is not a well-formed URI"), ("ftp://h/x", "cannot use ftp://")):
        assert main(["init", "--data", data, "--out", "bad.yaml"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dtrun: --data: trainer.data:") and why in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "bad.yaml").exists()
    assert main(["init", "--data", "./later", "--out", "later.yaml"]) == 0  # a folder to prepare later
    out = capsys.readouterr().out
    assert "note: trainer.data:" in out and "dtrun data prepare" in out and (tmp_path / "later.yaml").exists()


def test_init_never_overwrites_without_force(tmp_path, capsys):
    out = tmp_path / "job.yaml"
    out.write_text("mine\n")
    assert main(["init", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_text() == "mine\n"
    assert main(["init", "--out", str(out), "--force"]) == 0
    assert "name: job" in out.read_text()
    assert main(["init", "--out", str(tmp_path / "x.yaml"), "--model", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err and not (tmp_path / "x.yaml").exists()


def test_init_asks_on_a_terminal(tmp_path, capsys, monkeypatch, provider_credentials, dtrun_home):
    import io

    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    monkeypatch.setattr("orchestrator.cli.init._tty", lambda: True)
    monkeypatch.setattr("sys.stdin", io.StringIO("gpt2-124m\nA100-80GB\n\n30\n"))
    out = tmp_path / "asked.yaml"
    assert main(["init", "--out", str(out)]) == 0
    asked = capsys.readouterr().out
    assert "Model preset" in asked and "GPU" in asked and "Budget" in asked
    spec = yaml.safe_load(out.read_text())
    assert spec["trainer"]["model"] == "gpt2-124m" and spec["resources"]["gpu"] == "A100-80GB"
    assert spec["budget"]["max_usd"] == 30 and spec["trainer"]["data"] == "synthetic"
    assert main(["up", str(out), "--dry-run"]) == 0
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("\n\n\nfifty\n"))  # was a ValueError: 'internal error', exit 1
    assert main(["init", "--out", str(tmp_path / "typo.yaml")]) == 2
    err = capsys.readouterr().err
    assert "budget: 'fifty' is not a number" in err and "internal error" not in err
    assert not (tmp_path / "typo.yaml").exists()


def test_version(capsys):
    import re

    assert main(["--version"]) == 0
    want = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert capsys.readouterr().out.strip() == f"dtrun {want}"


def test_down_yes_and_the_question_on_a_terminal(tmp_path, capsys, monkeypatch, dtrun_home):
    import io

    from orchestrator.run.state import StateStore

    store = StateStore()
    store.create_job("done-job", "name: done-job\n", "file:///nowhere")
    store.set_state("done-job", "SUCCEEDED")
    assert main(["down", "done-job", "--yes"]) == 0
    store.create_job("live-job", "name: live-job\n", "file:///nowhere")
    store.set_state("live-job", "RUNNING")
    monkeypatch.setattr("orchestrator.cli.jobs._tty_in", lambda: True)
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    assert main(["down", "live-job"]) == 130
    assert "Stop live-job" in capsys.readouterr().out
    assert store.pop_action("live-job") is None  # nothing asked of the controller


def test_a_run_uri_failing_at_the_controllers_start_ends_the_job_not_pending(tmp_path):
    """Past the checks (another process, a disk that filled): the controller ends the job FAILED
    with the reason and rents nothing; it is never left PENDING."""
    from orchestrator.plan.spec import parse_spec
    from orchestrator.run.clock import VirtualClock
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import StateStore
    from orchestrator.run.uricheck import UriRefused
    from providers.fake import FakeOfferTemplate, FakeProvider

    (tmp_path / "a-file").write_text("x")
    spec = parse_spec({"name": "late", "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1},
                       "trainer": {"model": "tiny", "steps": 10, "batch_size": 8, "seq_len": 64},
                       "checkpoint": {"uri": f"file://{tmp_path}/a-file/run"}, "budget": {"max_usd": 10}})
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", False, 1.0)])
    store = StateStore(tmp_path / "state.db")
    with pytest.raises(UriRefused) as ei:
        Controller(spec, store, clock=clock, providers={"fake": cloud}).run()
    assert ei.value.exit_code == 6 and "a-file/run" in str(ei.value)
    row = store.get_job("late")
    assert row["state"] == "FAILED" and "cannot be used" in row["reason"]
    assert cloud.instances() == []


def test_synthetic_data_and_validation_are_not_anchored_as_paths(tmp_path):
    """``data: synthetic`` and ``val_data: synthetic`` are names, not paths: anchoring the job file's
    folder onto ``val_data`` made the trainer look for shards in ``<job folder>/synthetic``."""
    from orchestrator.plan.spec import JobSpec, anchor_paths

    spec = JobSpec.model_validate({"name": "anchor", "resources": {"providers": ["local"], "gpu": "cpu"},
                                   "trainer": {"steps": 2, "data": "synthetic", "val_data": "synthetic",
                                               "eval_every": 1},
                                   "checkpoint": {"uri": "runs/{name}"}})
    got = anchor_paths(spec, tmp_path)
    assert got.trainer.data == "synthetic" and got.trainer.val_data == "synthetic"
    assert str(tmp_path) in got.checkpoint.uri
