"""``dtrun report`` from a run with a preemption: the HTML embeds every plot, the PNGs beside it
are valid images, the preempted attempt is marked; it renders while the job is still running.

The job's history is written into a real state store and a real run URI (what the controller and
the trainer leave: attempts, spend rows, events, metrics.jsonl with training and validation rows),
without running a trainer: the subject is the report, and the history has a preemption in it.
"""

from __future__ import annotations

import json
import re

import pytest

from orchestrator.cli.app import main as dtrun
from orchestrator.run.report import PLOTS
from orchestrator.run.state import StateStore

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def history(dtrun_home, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    store = StateStore()
    t0 = 1_800_000_000.0
    store.create_job("rep", "name: rep\n", f"file://{run}", budget_usd=2.0, steps=40,
                     estimate={"cost_usd": 1.2, "expected_usd": 1.0, "hours": 0.5,
                               "breakdown": {"tokens": 40 * 512, "steps": 40, "step_seconds": 30.0, "mfu": 0.4}},
                     t=t0)
    store.update_job("rep", started_at=t0, state="RUNNING", step=40, loss=2.1, val_loss=2.4)
    store.new_attempt("rep", 1, {"gpu": "H100"}, "runpod", t0, start_step=0)
    store.update_attempt("rep", 1, state="ENDED", outcome="preempted", ended_at=t0 + 600, end_step=22,
                         launched_at=t0)
    store.new_attempt("rep", 2, {"gpu": "H100"}, "runpod", t0 + 700, start_step=20)
    store.update_attempt("rep", 2, state="RUNNING", launched_at=t0 + 700)
    store.open_spend("rep", 1, 2.0, t0)
    store.book_spend("rep", 1, t0 + 600, close=True)
    store.open_spend("rep", 2, 2.0, t0 + 700)
    store.book_spend("rep", 2, t0 + 1300)
    rows = []
    for step in range(2, 41, 2):
        att = 1 if step <= 22 else 2
        rows.append({"step": step, "loss": 5.0 - step * 0.07, "tokens": step * 512, "tokens_per_s": 1000.0 + step,
                     "mfu": 0.35, "attempt": att, "time": t0 + step * 30})
        if step % 10 == 0:
            rows.append({"step": step, "val_loss": 5.2 - step * 0.07, "tokens": step * 512, "attempt": att,
                         "time": t0 + step * 30})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"torn")  # a torn last line
    return store, tmp_path


def _check(html_path, state_text: str):
    html = html_path.read_text()
    imgs = re.findall(r'<img alt="(\w+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert [a for a, _ in imgs] == list(PLOTS)
    import base64

    for name, b64 in imgs:
        data = base64.b64decode(b64)
        assert data.startswith(PNG_MAGIC)
        assert (html_path.parent / f"{name}.png").read_bytes() == data
    import matplotlib.image

    for name in PLOTS:  # decodable images of a sensible size
        arr = matplotlib.image.imread(html_path.parent / f"{name}.png")
        assert arr.shape[0] > 200 and arr.shape[1] > 400
    assert "preempted" in html and state_text in html
    assert "<td>1.2000 (expected 1.0000)</td>" in html  # the estimate next to the actual
    return html


def test_report_of_a_preempted_run_while_running_and_after(history, capsys):
    store, tmp = history
    out = tmp / "r" / "report.html"
    assert dtrun(["report", "rep", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    html = _check(out, "still running")
    assert "validation loss 2.4000" in html
    store.set_state("rep", "SUCCEEDED", "training finished (DONE)")
    store.update_job("rep", finished_at=1_800_000_000.0 + 1400)
    assert dtrun(["report", "rep"]) == 0  # default path under DTRUN_HOME
    default = store.path.rsplit("/", 1)[0] + "/reports/rep/report.html"
    html = _check(__import__("pathlib").Path(default), "SUCCEEDED")
    assert "still running" not in html


def test_report_of_an_unknown_job_is_exit_6(dtrun_home, capsys):
    assert dtrun(["report", "nope"]) == 6
    assert "no job named 'nope'" in capsys.readouterr().err


def test_status_shows_the_validation_loss_and_points_to_the_report(history, capsys):
    assert dtrun(["status", "rep", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] == 2.4
    assert dtrun(["status", "rep"]) == 0
    out = capsys.readouterr().out
    assert "val loss 2.4000" in out and "dtrun report rep" in out
    from orchestrator.cli.live import progress_line, snapshot

    assert "val 2.4000" in progress_line(snapshot(history[0], "rep"))


def test_the_live_line_of_a_job_with_no_known_total_says_so():
    from orchestrator.cli.live import progress_line

    s = {"state": "RUNNING", "step": None, "steps": None, "loss": None, "tokens_per_s": None, "cost": 0.0,
         "budget": 1.0, "attempt": 1, "attempts": 1}
    line = progress_line(s)
    assert "step 0/?" in line and "0/0" not in line
