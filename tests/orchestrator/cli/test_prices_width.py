"""`dtrun prices` fits the terminal: piped, it prints in ``COLUMNS`` (100 when unset), each
price's source a numbered footnote under the table instead of a column that wrapped every row to
3-6 lines (issue 33, item 13); nothing the sources said is lost."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _prices(tmp_path, *argv, columns: str | None = "100") -> str:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update(DTRUN_HOME=str(tmp_path / "home"), DTRUN_SKY_CATALOG_DIR=str(tmp_path / "no-catalogs"))
    if columns is not None:
        env["COLUMNS"] = columns
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "prices", *argv], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.mark.parametrize("columns,width", [("100", 100), (None, 100), ("80", 80)])
def test_prices_piped_fit_the_width(tmp_path, columns, width):
    out = _prices(tmp_path, columns=columns)
    lines = out.splitlines()
    too_long = [ln for ln in lines if len(ln) > width]
    assert not too_long, f"{len(too_long)} of {len(lines)} lines over {width} columns: {too_long[:3]}"


def test_every_row_names_its_source_as_a_footnote(tmp_path):
    rows = json.loads(_prices(tmp_path, "--json"))["prices"]
    out = _prices(tmp_path)
    table = [ln for ln in out.splitlines() if re.search(r"\[\d+\]\s*$", ln) and not ln.startswith("[")]
    assert len(table) == len(rows)  # one line per price: nothing wraps
    notes: dict[str, str] = {}
    key = None
    for ln in out.splitlines()[out.splitlines().index(table[-1]) + 1:]:
        m = re.match(r"\[(\d+)\] (.*)", ln)
        if m:
            key, notes[m.group(1)] = m.group(1), m.group(2).strip()
        elif re.match(r"\w+: spot: ", ln):
            break
        elif key is not None:  # a footnote wrapped onto the next line
            notes[key] += " " + ln.strip()
    for ln, row in zip(table, rows):
        n = re.search(r"\[(\d+)\]\s*$", ln).group(1)
        want = row["price_source"] + (f" ({row['note']})" if row["note"] else "")
        assert notes[n] == " ".join(want.split()), (ln, notes[n])
        assert ln.split()[:2] == [row["gpu"], row["provider"]] and f"{row['price_per_gpu_hour']:.2f}" in ln
