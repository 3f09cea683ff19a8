"""A local node's temp files (issue 33 item 21): `kill -9` of a node used to leave its
``dtrun-<job>-*.yaml`` and the user command's ``dtrun-<job>-…/`` home in the system temp folder.
Each node now gets ``$DTRUN_HOME/local/tmp/<instance id>/`` as TMPDIR, removed once its process
group is gone: by poll, by terminate and by list_owned (`dtrun gc`) — also after a SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from providers.base import Handle, LaunchRequest, NodeState, Requirements
from providers.local import LocalProvider

# What the node bootstrap and a user command make with tempfile (infra/node_config.py,
# infra/usercode.py), then a long sleep: the node is killed while it holds them.
NODE = """
import json, sys, tempfile, time
fd, cfg = tempfile.mkstemp(prefix="dtrun-loc-", suffix=".yaml")
home = tempfile.mkdtemp(prefix="dtrun-user-hf-1-0-")
open(home + "/weights.bin", "w").write("x")
open(sys.argv[1], "w").write(json.dumps({"cfg": cfg, "home": home}))
time.sleep(120)
"""


def _wait(pred, timeout=15.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture
def local(dtrun_home):
    p = LocalProvider(grace_seconds=1.0, confirm_wait_seconds=5.0)
    yield p
    for o in p.list_owned():
        p.terminate(Handle("local", o.name, o.instance_id))


def _launch(p, tmp_path, attempt):
    out = tmp_path / f"paths-{attempt}.json"
    offer = p.offers(Requirements("cpu", 1))[0]
    h = p.launch(LaunchRequest("loc", attempt, offer, 1, [sys.executable, "-c", NODE, str(out)]))
    _wait(out.exists)
    _wait(lambda: out.read_text() != "")
    paths = json.loads(out.read_text())
    return h, Path(paths["cfg"]), Path(paths["home"])


def _kill9(h):
    os.killpg(int(h.data["pgid"]), signal.SIGKILL)


@pytest.mark.parametrize("cleaner", ["poll", "list_owned", "terminate"])
def test_a_sigkilled_nodes_temp_files_are_removed(local, tmp_path, dtrun_home, cleaner):
    h, cfg, home = _launch(local, tmp_path, 1)
    tmp_dir = Path(h.data["tmp_dir"])
    assert tmp_dir.parent == dtrun_home / "local" / "tmp"
    assert cfg.parent == tmp_dir and home.parent == tmp_dir  # not the system temp folder
    assert not str(cfg).startswith(tempfile.gettempdir() + "/dtrun-")
    assert cfg.exists() and (home / "weights.bin").exists()
    _kill9(h)
    other = LocalProvider(grace_seconds=1.0, confirm_wait_seconds=5.0)  # another process: `dtrun status`, gc
    if cleaner == "poll":
        _wait(lambda: other.poll(h) is NodeState.PREEMPTED)
    elif cleaner == "list_owned":
        _wait(lambda: other.list_owned() == [])
    else:
        other.terminate(h)
    assert not tmp_dir.exists()
    assert not cfg.exists() and not home.exists()


def test_a_live_nodes_temp_folder_is_kept(local, tmp_path):
    h, cfg, _home = _launch(local, tmp_path, 2)
    assert local.poll(h) is NodeState.RUNNING
    LocalProvider().list_owned()
    assert cfg.exists()
    local.terminate(h)
    assert not Path(h.data["tmp_dir"]).exists()
