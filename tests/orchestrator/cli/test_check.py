"""`dtrun check`: credentials (offline, and --online against a local HTTP server standing in for
each provider's API: accepted, rejected and silent keys), packages, rsync, SkyPilot's API server
(running / stale / none), and for a job its run URI (moto), data and this machine's torch."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import yaml

from orchestrator.cli.app import main

GOOD, BAD, SLOW = "good-key-1234567890", "bad-key-0987654321", "slow-key-5555555555"


@pytest.fixture
def home(no_credentials):
    return no_credentials


def keys(home: Path, runpod: str | None = None, lam: str | None = None, vast: str | None = None) -> None:
    if runpod is not None:
        (home / ".runpod").mkdir(exist_ok=True)
        (home / ".runpod" / "config.toml").write_text(f'[default]\napi_key = "{runpod}"\n')
    if lam is not None:
        (home / ".lambda_cloud").mkdir(exist_ok=True)
        (home / ".lambda_cloud" / "lambda_keys").write_text(f"api_key = {lam}\n")
    if vast is not None:
        (home / ".config" / "vastai").mkdir(parents=True, exist_ok=True)
        (home / ".config" / "vastai" / "vast_api_key").write_text(vast)


class _Handler(BaseHTTPRequestHandler):
    """Answers like the providers' APIs do for the one call each check makes (test stand-in: it
    checks only the bearer token; no other API behaviour is emulated)."""

    health: dict | None = {"status": "healthy", "version": "test"}

    def log_message(self, *a):  # quiet
        pass

    def _answer(self):
        if self.path.startswith("/api/health"):
            if self.health is None:
                time.sleep(3)
                return
            return self._send(200, self.health)
        if self.command == "POST":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        if auth == f"Bearer {SLOW}":
            time.sleep(3)
            return
        if auth != f"Bearer {GOOD}":
            return self._send(401, {"error": "unauthorized"})
        return self._send(200, {"data": {"myself": {"id": "u1"}}})

    def _send(self, code, body):
        data = json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_GET = do_POST = _answer


@pytest.fixture
def api(monkeypatch):
    """One local HTTP server on 127.0.0.1 standing in for RunPod's, Lambda's and Vast's APIs and
    SkyPilot's API server health endpoint."""
    handler = type("H", (_Handler,), {"health": {"status": "healthy", "version": "test"}})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    monkeypatch.setenv("RUNPOD_API_BASE_URL", url)
    monkeypatch.setenv("DTRUN_LAMBDA_API_URL", url + "/api/v1")
    monkeypatch.setenv("VAST_URL", url)
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", url)
    yield url, handler
    srv.shutdown()
    srv.server_close()
    t.join(5)


@pytest.fixture
def rsync_on_path(tmp_path, monkeypatch):
    """A stand-in ``rsync`` first on PATH: ``dtrun check`` only looks the binary up
    (``shutil.which``), so the test does not depend on the host having it (``make test`` runs on
    machines without rsync). Returns the stand-in's path."""
    bin_dir = tmp_path / "tools-bin"
    bin_dir.mkdir()
    rsync = bin_dir / "rsync"
    rsync.write_text("#!/bin/sh\necho 'rsync stand-in (tests/orchestrator/test_check.py)'\n")
    rsync.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return rsync


@pytest.fixture
def no_rsync_on_path(tmp_path, monkeypatch):
    """A PATH with no ``rsync`` on it, whatever the host has."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def _check(capsys, *args):
    rc = main(["check", *args, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == rc
    return rc, {i["name"]: i for i in out["items"]}, out


def test_no_credentials_is_exit_5_with_the_fix_per_provider(home, api, capsys):
    rc, items, out = _check(capsys)
    assert rc == 5 and out["ready_providers"] == []
    for p in ("runpod", "lambda", "vast", "modal"):
        assert items[p]["ok"] is False
        assert ("to fix" in items[p]["detail"]) if p != "modal" else ("modal token set" in items[p]["detail"])
    assert items["API server"]["ok"] is True and "running" in items["API server"]["detail"]
    assert "rsync" in items


def test_an_empty_key_file_and_an_unparsable_modal_toml_are_not_credentials(home, api, capsys):
    keys(home, vast="", runpod="", lam="")  # `api_key = ` with nothing after it once crashed the check
    (home / ".modal.toml").write_text("this is [not toml\n")
    rc, items, _ = _check(capsys)
    assert rc == 5
    assert "vast_api_key is empty" in items["vast"]["detail"]
    assert "empty api_key" in items["runpod"]["detail"] and "empty api_key" in items["lambda"]["detail"]
    assert "not a valid TOML file" in items["modal"]["detail"]
    (home / ".modal.toml").write_text('[default]\ntoken_id = "ak-1"\n')
    _rc, items, _ = _check(capsys)
    assert "no token_id/token_secret" in items["modal"]["detail"]
    (home / ".modal.toml").write_text('[me]\ntoken_id = "ak-1"\ntoken_secret = "as-1"\nactive = true\n')
    rc, items, out = _check(capsys)
    assert items["modal"]["ok"] is True and rc == 0 and out["ready_providers"] == ["modal"]


def test_online_asks_each_api_and_never_prints_a_key(home, api, capsys, rsync_on_path):
    keys(home, runpod=GOOD, lam=BAD, vast=SLOW)
    rc = main(["check", "--online", "--timeout", "1"])
    text = capsys.readouterr().out
    assert GOOD not in text and BAD not in text and SLOW not in text
    rc, items, out = _check(capsys, "--online", "--timeout", "1")
    assert items["runpod online"]["ok"] is True and "accepted the key" in items["runpod online"]["detail"]
    assert items["lambda online"]["ok"] is False and "rejected the key (HTTP 401)" in items["lambda online"]["detail"]
    assert items["vast online"]["ok"] is False and "within 1 s" in items["vast online"]["detail"]
    assert rc == 0 and out["ready_providers"] == ["runpod"]
    assert items["rsync"]["ok"] is True and items["rsync"]["detail"] == str(rsync_on_path)
    assert all(k not in json.dumps(out) for k in (GOOD, BAD, SLOW))


def test_without_rsync_no_skypilot_cloud_is_ready(home, api, capsys, no_rsync_on_path):
    keys(home, runpod=GOOD)
    rc, items, out = _check(capsys, "--online", "--timeout", "1")
    assert items["runpod"]["ok"] is True and items["runpod online"]["ok"] is True
    assert items["rsync"]["ok"] is False and "not found" in items["rsync"]["detail"]
    assert "apt-get install rsync" in items["rsync"]["fix"]
    assert rc == 5 and out["ready_providers"] == []


def test_runpod_graphql_errors_with_status_200_are_a_rejected_key(home, capsys, monkeypatch):
    class Gql(_Handler):
        def _answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(200, {"errors": [{"message": "Unauthorized"}]})

        do_POST = _answer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Gql)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        monkeypatch.setenv("RUNPOD_API_BASE_URL", f"http://127.0.0.1:{srv.server_address[1]}")
        keys(home, runpod=GOOD)
        from providers.skypilot import credentials

        why = credentials.online_problem("runpod", 2)
        assert why and "rejected the key (Unauthorized)" in why and GOOD not in why
    finally:
        srv.shutdown()
        srv.server_close()


def test_skypilot_api_server_running_stale_or_none(home, api, capsys, monkeypatch):
    import socket

    from orchestrator.run import readiness

    url, handler = api
    assert readiness.sky_server_item().ok is True
    handler.health = {"status": "unhealthy"}
    item = readiness.sky_server_item()
    assert item.ok is False and "stale" in item.detail and item.fix
    handler.health = None  # holds the port, never answers
    item = readiness.sky_server_item(timeout=0.5)
    assert item.ok is False and "did not answer" in item.detail
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    free = s.getsockname()[1]
    s.close()
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", f"http://127.0.0.1:{free}")
    item = readiness.sky_server_item()
    assert item.ok is True and "none running" in item.detail


def _job(tmp_path: Path, **over) -> Path:
    spec = {"name": "chk", "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 1},
            "trainer": {"model": "tiny", "steps": 5, "batch_size": 8, "seq_len": 64},
            "checkpoint": {"uri": str(tmp_path / "runs" / "{name}")}}
    for k, v in over.items():
        sect, key = k.split("__")
        spec[sect][key] = v
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(spec))
    return f


def _shard(vocab: int = 256) -> bytes:
    from trainer.shards import encode

    return encode(np.arange(1000, dtype=np.int64) % vocab, vocab)


def test_a_job_on_s3_probe_data_and_local_versions(tmp_path, home, api, capsys, s3_bucket):
    import boto3

    s3 = boto3.client("s3")
    s3.put_object(Bucket=s3_bucket[5:], Key="data/train_000000.bin", Body=_shard())
    f = _job(tmp_path, checkpoint__uri=f"{s3_bucket}/runs/{{name}}", trainer__data=f"{s3_bucket}/data/")
    rc, items, out = _check(capsys, str(f))
    assert rc == 0, out
    assert items["checkpoint.uri"]["ok"] is True and "wrote, read, listed and deleted" in items["checkpoint.uri"]["detail"]
    assert "endpoint http://127.0.0.1" in items["checkpoint.uri"]["detail"] and "region us-east-1" in items["checkpoint.uri"]["detail"]
    assert items["trainer.data"]["ok"] is True and "token shards found" in items["trainer.data"]["detail"]
    assert items["torch"]["ok"] is True and "CUDA" in items and "NCCL" in items
    assert s3.list_objects_v2(Bucket=s3_bucket[5:], Prefix="runs/").get("KeyCount", 0) == 0  # probe deleted
    # no shards under the data prefix: exit 6
    f = _job(tmp_path, checkpoint__uri=f"{s3_bucket}/runs/{{name}}", trainer__data=f"{s3_bucket}/empty/")
    rc, items, _ = _check(capsys, str(f))
    assert rc == 6 and items["trainer.data"]["ok"] is False and "no .bin or .npy" in items["trainer.data"]["detail"]
    # a bucket that does not exist: exit 6 naming it
    f = _job(tmp_path, checkpoint__uri="s3://no-such-bucket-chk/runs/{name}")
    rc, items, _ = _check(capsys, str(f))
    assert rc == 6 and "no-such-bucket-chk" in items["checkpoint.uri"]["detail"]


def test_a_job_whose_data_vocabulary_exceeds_the_model_is_exit_2(tmp_path, home, api, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train_000000.bin").write_bytes(_shard(256))
    (data / "manifest.json").write_text(json.dumps({"vocab_size": 50257, "tokenizer": {"name": "gpt2"}}))
    f = _job(tmp_path, trainer__data=str(data))
    rc, items, _ = _check(capsys, str(f))
    assert rc == 2 and items["vocabulary"]["ok"] is False and "50257" in items["vocabulary"]["detail"]


def test_a_job_with_only_unready_providers_is_exit_5_and_human_lines(tmp_path, home, api, capsys):
    f = _job(tmp_path, resources__providers=["runpod", "vast"], resources__gpu="H100",
             checkpoint__uri=str(tmp_path / "runs" / "{name}"))
    rc = main(["check", str(f)])
    text = capsys.readouterr().out
    assert rc == 5
    assert "✗ runpod:" in text and "✓ checkpoint.uri" in text and "chk: no provider it names is ready (exit 5)" in text
    assert "modal" not in text  # only the providers the job names


def test_a_command_job_checks_its_run_uri_and_leaves_its_data_to_it(tmp_path, home, api, capsys):
    (tmp_path / "train.py").write_text("print('step 1')\n")
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump({"name": "mine", "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 1},
                                 "command": {"run": "train.py", "hours": 0.1},
                                 "checkpoint": {"uri": str(tmp_path / "runs" / "{name}")}, "budget": {"max_usd": 1}}))
    rc, items, _ = _check(capsys, str(f))
    assert rc == 0 and items["checkpoint.uri"]["ok"] is True
    assert items["command"]["ok"] is None and "its own data" in items["command"]["detail"]


def test_a_failed_item_names_its_field_once(tmp_path, home, api, capsys):
    f = _job(tmp_path, checkpoint__uri="s3:/my-bucket/runs/{name}")
    assert main(["check", str(f)]) == 6
    text = capsys.readouterr().out
    assert "✗ checkpoint.uri: 's3:/my-bucket/runs/chk' is not a well-formed URI" in text
    assert "checkpoint.uri: checkpoint.uri:" not in text


def test_the_probe_leaves_no_folder_behind_and_keeps_the_ones_that_were_there(tmp_path, home, api, capsys):
    from orchestrator.run.uricheck import probe_run_uri

    (tmp_path / "kept").mkdir()
    assert probe_run_uri(f"file://{tmp_path}/kept/runs/job") is None
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "runs").exists()
    (tmp_path / "used" / "runs" / "job").mkdir(parents=True)
    (tmp_path / "used" / "runs" / "job" / "progress.json").write_text("{}")
    assert probe_run_uri(f"file://{tmp_path}/used/runs/job") is None
    assert sorted(p.name for p in (tmp_path / "used" / "runs" / "job").iterdir()) == ["progress.json"]


# ---- local: ready when this machine can run the trainer (issue 33, item 19) ----------------------

def test_without_clouds_check_says_local_works(home, api, capsys):
    rc = main(["check"])
    text = capsys.readouterr().out
    assert rc == 5  # nothing to rent from
    assert "no cloud provider is ready to rent from (exit 5)" in text and "no provider is ready" not in text
    assert "local is ready: this machine can run the trainer (torch " in text and "✓ torch:" in text
    rc, items, out = _check(capsys)
    assert rc == 5 and out["ready_providers"] == [] and out["local_ready"] is True
    assert items["torch"]["ok"] is True


def test_without_torch_local_is_not_ready(tmp_path, home, api, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    rc = main(["check"])
    text = capsys.readouterr().out
    assert rc == 5 and "local cannot run the trainer here: torch not installed → pip install torch" in text
    # a trainer job on local: not ready (exit 5, local not among the ready providers)
    rc, items, out = _check(capsys, str(_job(tmp_path)))
    assert rc == 5 and out["ready_providers"] == [] and out["local_ready"] is False
    assert main(["check", str(_job(tmp_path))]) == 5
    assert "chk: no provider it names is ready (exit 5); local cannot run the trainer here" in capsys.readouterr().out
    # a command job brings its own program: local stays ready
    f = tmp_path / "cmd.yaml"
    (tmp_path / "train.py").write_text("print('step 1')\n")
    f.write_text(yaml.safe_dump({"name": "mine", "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 1},
                                 "command": {"run": "train.py", "hours": 0.1},
                                 "checkpoint": {"uri": str(tmp_path / "runs" / "{name}")}, "budget": {"max_usd": 1}}))
    rc, _items, out = _check(capsys, str(f))
    assert rc == 0 and out["ready_providers"] == ["local"] and out["local_ready"] is True
