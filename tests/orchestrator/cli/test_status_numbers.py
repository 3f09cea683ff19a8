"""``dtrun status JOB`` shows the run URI's numbers when they are past the controller's record:
the trainer's ``progress.json`` (the controller is gone while the node trains on) and the newest
COMMITTED checkpoint (the trainer's last save after the controller stopped reading), and says
where the number came from."""

from __future__ import annotations

import time

from orchestrator.cli.jobs import _print_status, job_status
from orchestrator.contract import runuri
from orchestrator.run.state import StateStore


def job(tmp_path, step, state="RUNNING"):
    store = StateStore(tmp_path / "state.db")
    uri = f"file://{tmp_path}/run"
    store.create_job("nums", "name: nums\n", uri, steps=3000)
    store.update_job("nums", step=step, last_committed_step=(step // 100) * 100 or None, loss=4.0,
                     progress_time=time.time() - 600)
    if state != "PENDING":
        store.set_state("nums", state, None)
    return store, uri


def commit(uri, step, loss=None):
    runuri.write_json(runuri.join(runuri.checkpoint_uri(uri, step), runuri.COMMITTED),
                      {"step": step, "time": time.time() - 30, **({"loss": loss} if loss is not None else {})})


def test_progress_past_the_record_is_shown_and_labelled(tmp_path, capsys):
    store, uri = job(tmp_path, 100)
    commit(uri, 400)
    runuri.write_json(runuri.join(uri, runuri.PROGRESS), {"step": 500, "loss": 3.5, "last_committed_step": 400,
                                                          "time": time.time() - 5})
    st = job_status(store, store.get_job("nums"), live=True)
    assert (st["step"], st["step_source"], st["recorded_step"]) == (500, "progress.json", 100)
    assert st["last_committed_step"] == 400 and st["loss"] == 3.5
    _print_status(st)
    out = capsys.readouterr().out
    assert "step 500/3000" in out
    assert "step from the run URI's progress.json, 0m0" in out and "(the controller's record says 100)" in out


def test_a_newer_committed_checkpoint_after_down_is_the_step(tmp_path, capsys):
    store, uri = job(tmp_path, 268, state="CANCELLED")
    runuri.write_json(runuri.join(uri, runuri.PROGRESS), {"step": 268, "time": time.time() - 60})
    commit(uri, 300)
    commit(uri, 319, loss=2.25)
    runuri.write_text(runuri.join(runuri.checkpoint_uri(uri, 330), "partial"), "")  # not COMMITTED: ignored
    st = job_status(store, store.get_job("nums"), live=True)
    assert (st["step"], st["step_source"], st["last_committed_step"]) == (319, "checkpoints/step-319", 319)
    assert st["loss"] == 2.25 and st["watched"] is None
    _print_status(st)
    out = capsys.readouterr().out
    assert "step 319/3000" in out and "step from the run URI's checkpoints/step-319" in out


def test_the_record_stands_when_it_is_newest_or_the_run_uri_cannot_be_read(tmp_path, capsys):
    store, uri = job(tmp_path, 700)
    commit(uri, 600)
    runuri.write_json(runuri.join(uri, runuri.PROGRESS), {"step": 650, "time": time.time() - 60})
    st = job_status(store, store.get_job("nums"), live=True)
    assert (st["step"], st["step_source"], st["last_committed_step"]) == (700, "controller", 700 // 100 * 100)
    _print_status(st)
    assert "step from the run URI" not in capsys.readouterr().out
    # ls / status of every job: the record only (no run-URI reads)
    assert job_status(store, store.get_job("nums"))["step_source"] == "controller"
    runuri.remove(runuri.join(uri, runuri.PROGRESS))
    (tmp_path / "run" / runuri.PROGRESS).mkdir()  # unreadable: a folder where the file should be
    st = job_status(store, store.get_job("nums"), live=True)
    assert st["step"] == 700 and st["step_source"] == "controller" and "IsADirectoryError" in st["run_uri_error"]
    _print_status(st)
    assert "step from the controller's record (the run URI could not be read: IsADirectoryError" in \
        capsys.readouterr().out


def test_attempt_list_names_every_attempt_billed_or_not(tmp_path):
    """A failover: attempt 1 found no capacity on Vast (nothing rented, so `dtrun cost` has no row),
    attempt 2 ran on RunPod; `dtrun status --json` lists both with where they went and how they ended."""
    from providers.base import Offer

    store, _ = job(tmp_path, 30, state="SUCCEEDED")
    vast = Offer(provider="vast", region="any", gpu="A100-80GB", gpus_per_node=1, nodes=1, spot=True,
                 price_per_gpu_hour=0.35)
    runpod = Offer(provider="runpod", region="US", gpu="A100-80GB", gpus_per_node=1, nodes=1, spot=True,
                   price_per_gpu_hour=0.83)
    store.new_attempt("nums", 1, vast.to_dict(), "vast", time.time() - 100)
    store.update_attempt("nums", 1, state="ENDED", outcome="no_capacity", reason="vast: no offer left")
    store.new_attempt("nums", 2, runpod.to_dict(), "runpod", time.time() - 90)
    store.update_attempt("nums", 2, state="ENDED", outcome="succeeded", reason="DONE")
    st = job_status(store, store.get_job("nums"))
    assert st["attempt_list"] == [
        {"attempt": 1, "provider": "vast", "offer": "vast/any/A100-80GBx1/spot", "state": "ENDED",
         "outcome": "no_capacity", "reason": "vast: no offer left"},
        {"attempt": 2, "provider": "runpod", "offer": "runpod/US/A100-80GBx1/spot", "state": "ENDED",
         "outcome": "succeeded", "reason": "DONE"}]
