"""The node side of a ``command:`` job (infra/usercode.py), without torchrun: what counts as a
finished checkpoint for each format (the frameworks' own writers where they run here), the
upload/COMMITTED/retention cycle, the restore of the newest COMMITTED checkpoint (a partial one
never), and progress from output lines."""

from __future__ import annotations

import io
import json
import os
import re
from types import SimpleNamespace

import pytest

from infra import usercode, usercode_sync
from infra.usercode_formats import Found, finished
from infra.usercode_progress import Progress, Tee
from orchestrator.contract import runuri
from orchestrator.plan.spec import DEFAULT_LOSS_PATTERN, DEFAULT_STEP_PATTERN


def _hf_folder(root, step, state=True):
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"w" * 10)
    if state:
        (d / "trainer_state.json").write_text("{}")
    return d


def test_hf_counts_a_folder_once_the_next_save_began_or_the_command_exited(tmp_path):
    _hf_folder(tmp_path, 10)
    assert finished("hf", str(tmp_path), exited=False) == []  # other ranks may still write rng files
    assert finished("hf", str(tmp_path), exited=True) == [Found(10, "checkpoint-10", True)]
    _hf_folder(tmp_path, 20, state=False)  # the next save began
    assert finished("hf", str(tmp_path), exited=False) == [Found(10, "checkpoint-10", True)]
    # without trainer_state.json a folder is never finished, even after exit (killed mid-save)
    assert [f.step for f in finished("hf", str(tmp_path), exited=True)] == [10]


def test_dcp_counts_a_folder_with_metadata_written_by_torch(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(8.0)}, checkpoint_id=str(tmp_path / "step_30"))
    (tmp_path / "step_40").mkdir()
    (tmp_path / "step_40" / "__0_0.distcp").write_bytes(b"partial")  # data, no .metadata yet
    assert finished("dcp", str(tmp_path), exited=True) == [Found(30, "step_30", True)]


def test_lightning_counts_ckpt_files_from_its_atomic_save(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    import torch
    from lightning.fabric.utilities.cloud_io import _atomic_save

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # what the node gives the command
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    ck = tmp_path / "ckpt"
    ck.mkdir()
    _atomic_save({"w": torch.ones(3)}, str(ck / "epoch=0-step=50.ckpt"))
    _atomic_save({"w": torch.ones(3)}, str(ck / "last.ckpt"))
    (ck / "notes.txt").write_text("x")
    numbering: dict[str, int] = {}
    assert finished("lightning", str(ck), exited=False, numbering=numbering) == [
        Found(50, "epoch=0-step=50.ckpt", False)]
    _atomic_save({"w": torch.ones(3)}, str(ck / "mine.ckpt"))  # no step in the name: numbered
    assert [f.rel for f in finished("lightning", str(ck), False, numbering)][-1] == "mine.ckpt"


def test_marker_step_from_the_file_or_the_folder_name(tmp_path):
    from infra.adapters.marker import done_writing, latest

    (tmp_path / "a").mkdir()
    done_writing(str(tmp_path / "a"), 7)
    (tmp_path / "step-9").mkdir()
    (tmp_path / "step-9" / "DONE_WRITING").write_text("")
    (tmp_path / "step-12").mkdir()  # still writing
    assert finished("marker", str(tmp_path), exited=True) == [Found(7, "a", True), Found(9, "step-9", True)]
    assert latest(str(tmp_path)) == (9, str(tmp_path / "step-9"))


def test_progress_default_patterns_read_the_common_formats():
    p = Progress(re.compile(DEFAULT_STEP_PATTERN), re.compile(DEFAULT_LOSS_PATTERN))
    for line, step, loss in [("step 12/100 loss 3.25", 12, 3.25), ("iter 13: loss 3.1, time 20ms", 13, 3.1),
                             ("{'loss': 2.5, 'grad_norm': 1.0, 'global_step': 14}", 14, 2.5),
                             ("Epoch 0 | step=15 | loss=2.0e+00", 15, 2.0),
                             ("dtrun: step 16/100 loss 1.5", 16, 1.5)]:
        p.feed(line)
        assert (p.step, p.loss) == (step, loss), line
    assert p.steps == 100
    p.feed("step 3 loss 9")  # an older step from another rank's line does not move it back
    assert p.step == 16
    out = io.BytesIO()
    tee = Tee(out, p)
    tee.write(b"step 17 loss 1\r step 18 lo")
    tee.write(b"ss 0.5\nbye")
    tee.close()
    assert p.step == 18 and p.loss == 0.5 and out.getvalue().endswith(b"bye")


def _session(tmp_path, uri, fmt="marker", rank=0, nnodes=1, keep=2, monkeypatch=None):
    cfg = SimpleNamespace(run_uri=uri, job="j", attempt=1, node_rank=rank, nnodes=nnodes)
    if monkeypatch is not None:
        monkeypatch.setenv("DTRUN_NODE_DIR", str(tmp_path / f"node-{rank}"))
    cmd = {"run": "train.py", "checkpoint_format": fmt, "_keep": keep,
           "step_pattern": DEFAULT_STEP_PATTERN, "loss_pattern": DEFAULT_LOSS_PATTERN}
    return usercode.UserCommand(cfg, cmd, ["--standalone"], "launch.py")


def _marker_ckpt(root, step, payload=b"x"):
    d = os.path.join(root, f"step-{step}")
    os.makedirs(d)
    with open(os.path.join(d, "state.pt"), "wb") as f:
        f.write(payload)
    with open(os.path.join(d, "DONE_WRITING"), "w") as f:
        f.write(json.dumps({"step": step}))


def test_upload_commits_whole_folders_and_keeps_the_newest(tmp_path, monkeypatch):
    uri = f"file://{tmp_path}/run"
    s = _session(tmp_path, uri, keep=2, monkeypatch=monkeypatch)
    for step in (10, 20, 30):
        _marker_ckpt(s.ckpt_dir, step, payload=str(step).encode())
    os.makedirs(os.path.join(s.ckpt_dir, "step-40"))  # being written: not uploaded
    assert s.sync(exited=False) == [10, 20, 30]
    assert runuri.checkpoint_steps(uri) == [20, 30]  # checkpoint.keep: 2
    rec = runuri.committed(uri, 30)
    assert rec["format"] == "marker" and rec["files"] == 2 and rec["path"] == "step-30"
    assert runuri.read_text(runuri.join(runuri.checkpoint_uri(uri, 30), "step-30/state.pt")) == "30"
    assert s.sync(exited=True) == []  # nothing twice


def test_restore_takes_the_newest_committed_and_never_a_partial_one(tmp_path, monkeypatch):
    uri = f"file://{tmp_path}/run"
    first = _session(tmp_path, uri, monkeypatch=monkeypatch)
    _marker_ckpt(first.ckpt_dir, 10, b"ten")
    first.sync(exited=True)
    # a node died while uploading step 20: files there, no COMMITTED
    part = runuri.checkpoint_uri(uri, 20)
    runuri.write_text(runuri.join(part, "step-20/state.pt"), "half")
    runuri.write_text(runuri.join(part, "step-20/DONE_WRITING"), '{"step": 20}')
    monkeypatch.setenv("DTRUN_NODE_DIR", str(tmp_path / "node-b"))
    nxt = _session(tmp_path, uri)
    nxt._restore()
    assert nxt.resume_step == 10 and nxt.env()["DTRUN_RESUME_STEP"] == "10"
    assert open(os.path.join(nxt.ckpt_dir, "step-10", "state.pt")).read() == "ten"
    assert not os.path.exists(os.path.join(nxt.ckpt_dir, "step-20"))
    assert runuri.checkpoint_steps(uri) == [10]  # node 0 removed the partial folder
    assert nxt.sync(exited=True) == []  # the restored checkpoint is not uploaded again


def test_commit_waits_for_every_node(tmp_path, monkeypatch):
    uri = f"file://{tmp_path}/run"
    monkeypatch.setattr(usercode_sync, "COMMIT_WAIT_SECONDS", 0.5)
    n1 = _session(tmp_path, uri, rank=1, nnodes=2, monkeypatch=monkeypatch)
    n0 = _session(tmp_path, uri, rank=0, nnodes=2, monkeypatch=monkeypatch)
    _marker_ckpt(n0.ckpt_dir, 10)
    assert n0.sync(exited=True) == []  # node 1's part is missing: not committed
    assert runuri.committed(uri, 10) is None
    _marker_ckpt(n1.ckpt_dir, 20)
    _marker_ckpt(n0.ckpt_dir, 20)
    n1.sync(exited=True)
    assert n0.sync(exited=True) == [20] and runuri.committed(uri, 20)["nodes"] == 2


def test_finish_writes_done_only_for_an_unasked_exit_0(tmp_path, monkeypatch):
    uri = f"file://{tmp_path}/run"
    s = _session(tmp_path, uri, monkeypatch=monkeypatch)
    s.progress.feed("step 5/5 loss 1.0")
    assert s.finish(0, stopped=True) == 75  # stopped (SIGTERM/watchdog) and exited 0: resume it
    assert not runuri.exists(runuri.join(uri, runuri.DONE))
    s = _session(tmp_path, uri, monkeypatch=monkeypatch)
    s.progress.feed("step 5/5 loss 1.0")
    assert s.finish(0, stopped=False) == 0
    done = runuri.read_json(runuri.join(uri, runuri.DONE))
    assert done["step"] == 5 and done["source"] == "command"
    assert runuri.read_json(runuri.join(uri, runuri.PROGRESS))["step"] == 5


def test_argv_expands_only_dtrun_variables_never_a_secret(tmp_path, monkeypatch):
    """The node logs the argv into the run URI's node log: only DTRUN_ variables are expanded."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-123")
    s = _session(tmp_path, f"file://{tmp_path}/run", monkeypatch=monkeypatch)
    s.c["run"] = "train.py --out $DTRUN_CHECKPOINT_DIR --key $AWS_SECRET_ACCESS_KEY"
    argv = s.argv()
    assert argv[-4:] == ["--out", s.ckpt_dir, "--key", "$AWS_SECRET_ACCESS_KEY"]
    assert "s3cr3t-value-123" not in " ".join(argv)


def test_metrics_rows_follow_the_steps_with_a_loss_thinned_per_beat(tmp_path, monkeypatch):
    uri = f"file://{tmp_path}/run"
    s = _session(tmp_path, uri, monkeypatch=monkeypatch)
    for i in range(1, 11):
        s.progress.feed(f"step {i}/10 loss {1 / i:.3f}")
    s.write_progress()
    s.progress.feed("step 11/10 loss 0.05")
    s.write_progress()
    s.write_progress()  # nothing new: no row
    rows = [json.loads(x) for x in runuri.read_text(runuri.join(uri, runuri.METRICS)).splitlines()]
    assert [r["step"] for r in rows] == [3, 5, 8, 10, 11]  # four per beat at most, evenly, the newest kept
    assert rows[-1]["loss"] == 0.05 and all("loss" in r for r in rows)


def test_the_hf_callback_says_once_when_the_ranks_cannot_agree_on_a_stop_step(monkeypatch, capsys):
    import signal

    import torch.distributed as dist

    from infra.adapters.hf import DtrunCallback

    prev = signal.getsignal(signal.SIGTERM)
    try:
        cb = DtrunCallback(exit_on_stop=False)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        monkeypatch.setattr(dist, "get_backend", lambda: "gloo")

        def broken(*a, **k):
            raise RuntimeError("Connection closed by peer")

        monkeypatch.setattr(dist, "all_reduce", broken)
        cb.signalled = True
        assert cb._agreed() is True and cb._agreed() is True  # its own flag
        err = capsys.readouterr().err
        assert err.count("cannot agree on a stop step") == 1 and "Connection closed by peer" in err
    finally:
        signal.signal(signal.SIGTERM, prev)


def test_the_requirements_file_is_quoted_for_the_shell(tmp_path, monkeypatch):
    s = _session(tmp_path, f"file://{tmp_path}/run", monkeypatch=monkeypatch)
    s.c["requirements"] = "my reqs;touch pwned.txt"
    ran = []
    monkeypatch.setattr(s, "_run_setup", ran.append)
    s._setup()
    assert ran and ran[0].endswith("-m pip install -r 'my reqs;touch pwned.txt'")
