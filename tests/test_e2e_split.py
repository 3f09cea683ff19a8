"""``make e2e``'s splitter (tests/e2e/split.py): the groups' pytest command lines, one line and exit 2
for a bad group, and the exit status of real child processes (a failing group fails the whole)."""

from __future__ import annotations

import subprocess
import sys

from tests.e2e import split


def test_groups_and_the_rest_ignore_what_the_groups_run():
    cmds = split.commands(["spot=tests/e2e/runpod_cloud,tests/e2e/vast_cloud"], "rest", ["-q"])
    assert [n for n, _ in cmds] == ["spot", "rest"]
    assert cmds[0][1][-2:] == ["tests/e2e/runpod_cloud", "tests/e2e/vast_cloud"]
    assert cmds[1][1][-3:] == ["tests", "--ignore=tests/e2e/runpod_cloud", "--ignore=tests/e2e/vast_cloud"]
    assert all(argv[1:6] == ["-m", "pytest", "-m", "e2e", "-q"] for _, argv in cmds)


def test_a_bad_group_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "tests.e2e.split", "x=tests/no/such", "rest"], capture_output=True,
                       text=True, cwd=split.REPO, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "tests.e2e.split: group x: no such path 'tests/no/such'"
    r = subprocess.run([sys.executable, "-m", "tests.e2e.split", "nopaths", "rest"], capture_output=True,
                       text=True, cwd=split.REPO, timeout=60)
    assert r.returncode == 2 and "expected NAME=PATH" in r.stderr and "Traceback" not in r.stderr


def test_the_exit_status_is_the_failing_groups_and_every_line_is_prefixed(capsys):
    ok = [sys.executable, "-c", "print('fine')"]
    bad = [sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"]
    assert split.run([("a", ok), ("b", bad)]) == 3
    out = capsys.readouterr().out
    assert "[a] fine" in out and "[b] broken" in out and "[b] exit 3 after" in out
    assert split.run([("a", ok), ("b", ok)]) == 0
