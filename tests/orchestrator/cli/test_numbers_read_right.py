"""Numbers as a person reads them (issue 33, item 20): token and parameter counts with K/M/B/T
(not ``1.41e+03B`` or ``0.000154B``), the live view's budget label from the first frame (not
``(no budget cap)`` for a $1 budget before the controller recorded the job), and ``--help``
listing every command's first sentence whole (not cut off with "...")."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.app import first_sentence, main
from orchestrator.cli.planview import fmt_count

ROOT = Path(__file__).resolve().parents[3]
GPT2 = ROOT / "jobs" / "gpt2-124m.yaml"


@pytest.mark.parametrize("n,text", [(154_000, "154K"), (1.41e12, "1.41T"), (8e9, "8B"), (2.6e10, "26B"),
                                    (124.4e6, "124M"), (999_950, "1M"), (999, "999"), (20_000, "20K"),
                                    (1.2345e6, "1.23M"), (99.96e9, "100B"), (1e15, "1,000T")])
def test_counts_have_a_unit_and_no_exponent(n, text):
    assert fmt_count(n) == text


# (a tiny run of the bundled trainer is timed by its per-step floor, a line that names steps)
@pytest.mark.parametrize("kind,tokens,shown", [("trainer", 1_410_000_000_000, "1.41T tokens"),
                                               ("command", 1_410_000_000_000, "1.41T tokens"),
                                               ("command", 154_000, "154K tokens")])
def test_the_dry_run_writes_token_counts_with_a_unit(kind, tokens, shown, tmp_path, capsys, provider_credentials,
                                                     dtrun_home, monkeypatch):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    data = yaml.safe_load(GPT2.read_text())
    data["budget"] = {"max_usd": 10_000_000}
    if kind == "trainer":
        data["trainer"]["tokens"] = tokens
    else:
        del data["trainer"]
        data["command"] = {"run": "train.py", "checkpoint_format": "marker", "params": 124e6, "tokens": tokens}
        (tmp_path / "train.py").write_text("print('step 1')\n")
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data))
    main(["up", str(f), "--dry-run"])
    out = capsys.readouterr().out
    compute = next(ln for ln in out.splitlines() if ln.strip().startswith("compute"))
    assert shown in compute, compute
    assert "e+" not in compute and "0.000154" not in compute and "124M params" in compute, compute


def _frame(store, name: str, budget=None) -> str:
    from rich.console import Console

    from orchestrator.cli.live import RichView

    con = Console(file=io.StringIO(), width=200, record=True)
    view = RichView(store, name, console=con, budget=budget)
    con.print(view._render())
    return con.export_text()


def test_the_first_live_frame_shows_the_budget_before_the_job_is_recorded(dtrun_home):
    from orchestrator.run.state import StateStore

    store = StateStore()
    first = _frame(store, "tiny", budget=1.0)  # the controller has not recorded the job yet
    assert "/ $1.00" in first and "no budget cap" not in first, first
    assert "no budget cap" not in _frame(store, "tiny"), "unknown is not 'no cap'"
    store.create_job("tiny", "name: tiny\n", "file:///tmp/x", budget_usd=1.0)
    assert "/ $1.00" in _frame(store, "tiny") and "no budget cap" not in _frame(store, "tiny")
    store.create_job("free", "name: free\n", "file:///tmp/y", budget_usd=None)
    assert "(no budget cap)" in _frame(store, "free")


def test_plain_progress_line_says_a_budget_of_one_dollar():
    from orchestrator.cli.live import progress_line

    s = {"state": "RUNNING", "step": 1, "steps": 10, "loss": None, "val_loss": None, "tokens_per_s": None,
         "cost": 0.25, "budget": 1.0, "attempt": 1, "attempts": 1}
    assert "spend $0.2500 of $1.00" in progress_line(s)


def _commands(text: str) -> dict[str, str]:
    """``--help``'s Commands section: name → its text, continuation lines joined."""
    out: dict[str, str] = {}
    name = None
    for ln in text.split("Commands:", 1)[1].splitlines():
        m = re.match(r"  (\S+)\s{2,}(.*)", ln)
        if m:
            name, out[m.group(1)] = m.group(1), m.group(2).strip()
        elif name and ln.strip():
            out[name] += " " + ln.strip()
    return out


@pytest.mark.parametrize("argv,group", [(["--help"], None), (["data", "--help"], "data")])
def test_help_lists_each_commands_first_sentence_whole(argv, group, capsys):
    import typer.main

    from orchestrator.cli.app import app

    assert main(argv) == 0
    listed = _commands(capsys.readouterr().out)
    cmd = typer.main.get_command(app)
    if group:
        cmd = cmd.commands[group]
    assert set(listed) == {n for n, c in cmd.commands.items() if not c.hidden}
    for n, text in listed.items():
        assert not text.endswith("..."), (n, text)
        assert text == first_sentence(cmd.commands[n].help or ""), n


def test_first_sentence():
    assert first_sentence("Do X (e.g. with --y). Then Z.\n\nMore.") == "Do X (e.g. with --y)."
    assert first_sentence("No full stop\nacross lines") == "No full stop across lines"
