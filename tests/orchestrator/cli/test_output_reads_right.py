"""Output that reads right (issue 23): the dry run's offers table fits a 100-column terminal
(price sources as numbered footnotes), one unit in the hours column, local jobs have no price
and no start-up money warning, "your trainer.parallel" only when the file sets it, `status`
rounds the loss and shows a FAILED job's log tail, and the job files' comments name real targets."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from orchestrator.cli.app import main
from orchestrator.cli.jobs import _print_status
from orchestrator.cli.planview import plan_report, print_plan
from orchestrator.run.prepare import run_spec
from orchestrator.plan.estimate import make_plan
from orchestrator.plan.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]
GPT2 = ROOT / "jobs" / "gpt2-124m.yaml"
QUICKSTART = ROOT / "jobs" / "quickstart.yaml"


@pytest.fixture(autouse=True)
def _usable(tmp_path, monkeypatch, provider_credentials):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))


def _render(job: Path, width: int = 100) -> str:
    spec = load_spec(job)
    plan = make_plan(run_spec(spec), usable_only=True)
    buf = io.StringIO()
    con = Console(file=buf, width=width, no_color=True, highlight=False, soft_wrap=False)
    print_plan(spec, plan, plan_report(spec, plan), console=con)
    return buf.getvalue()


def test_the_offers_table_fits_100_columns_with_sources_as_footnotes():
    out = _render(GPT2)
    lines = out.splitlines()
    assert all(len(x.rstrip()) <= 100 for x in lines), max(lines, key=len)
    header = next(x for x in lines if "provider" in x)
    for col in ("#", "provider", "region", "gpu", "spot", "$/GPU-h", "$/h", "hours", "est. $", "fits", "src"):
        assert col in header
    assert "…" not in out
    rows = [x for x in lines if re.match(r"^\s*\d+\s+(runpod|lambda|vast|modal)\s", x)]
    assert len(rows) >= 4
    # one line per offer: the source is a footnote number, each footnote printed once below
    notes = [x for x in lines if re.match(r"^\[\d+\] ", x)]
    cited = {int(n) for x in rows for n in re.findall(r"\[(\d+)\]\s*$", x)}
    assert len(cited) == len(notes) and cited == set(range(1, len(notes) + 1))
    table = lines[next(i for i, x in enumerate(lines) if "Offers" in x):next(i for i, x in enumerate(lines)
                                                                                if x.startswith("[1] "))]
    assert len(table) <= len(rows) + 5


def test_hours_are_hours_everywhere():
    for job in (GPT2, QUICKSTART):
        out = _render(job, width=200)
        for line in out.splitlines():
            if re.match(r"^\s*\d+\s+\w+\s", line) or line.lstrip().startswith(("compute", "checkpoints", "total",
                                                                                   "preemptions")):
                assert not re.search(r"\d min\b", line), line
        assert re.search(r"^\s*total\s+[\d.,]+ h\b", out, re.M), out


def test_a_local_job_has_no_price_and_no_start_up_money_warning(capsys):
    out = _render(QUICKSTART, width=200)
    assert "local: no price" in out
    assert "spends much of its money" not in out and "startup-dominates" not in out
    assert " 0 TFLOP/s" not in out and "GFLOP/s" in out  # a CPU's peak is not "0 TFLOP/s"
    rc = main(["up", str(QUICKSTART), "--dry-run", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and "startup-dominates" not in [t["code"] for t in rep["traps"]]


def _job_without(tmp_path, parallel):
    data = yaml.safe_load(QUICKSTART.read_text())
    data["trainer"].pop("parallel")
    if parallel is not None:
        data["trainer"]["parallel"] = parallel
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def test_your_parallel_only_when_the_file_sets_it(tmp_path):
    out = _render(_job_without(tmp_path, None), width=200)
    assert "your trainer.parallel" not in out and "default trainer.parallel (none set)" in out
    out = _render(_job_without(tmp_path, {"dp_shard": 2, "tp": 1}), width=200)
    assert "your trainer.parallel" in out


def _status_row(**over):
    row = {"name": "j", "state": "RUNNING", "reason": None, "step": 10, "steps": 100, "loss": 5.619625091552734,
           "val_loss": None, "cost_usd": 0.0, "budget_usd": None, "attempts": 1, "steps_lost": 0,
           "controller_pid": None, "nodes": [], "run_uri": "file:///x"}
    row.update(over)
    return row


def test_status_rounds_the_loss_and_shows_the_failed_log_tail(capsys):
    _print_status(_status_row())
    out = capsys.readouterr().out
    assert "loss 5.6196 " in out and "5.619625" not in out
    _print_status(_status_row(state="FAILED", loss=None, reason="attempt 1: the trainer failed; last trainer log "
                              "lines:\nTraceback (most recent call last):\nValueError: bad shard"))
    out = capsys.readouterr().out
    assert "ValueError: bad shard" in out and "loss —" in out


def test_job_file_comments_name_make_targets_that_run_them():
    makefile = (ROOT / "Makefile").read_text()
    targets = dict(re.findall(r"^([\w-]+):[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.M))
    seen = 0
    for job in sorted((ROOT / "jobs").glob("*.yaml")):
        comments = "".join(x for x in job.read_text().splitlines(True) if x.startswith("#"))
        for target in re.findall(r"`make ([\w-]+)`\s+(?:runs|builds|trains)", comments):
            seen += 1
            assert target in targets, f"{job.name}: `make {target}` is not a Makefile target"
            assert f"jobs/{job.name}" in targets[target], f"{job.name}: `make {target}` does not run it"
    assert seen
