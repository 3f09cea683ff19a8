"""Modal through the real ``modal`` client against a local fake of Modal's gRPC control plane
(tests/fakes/fake_modal_server.py): what a user with a real account would hit — no GPU
capacity, a failing image build, the image's layers, abnormal endings (OOM, eviction, timeout,
already finished), name collisions, vanished sandboxes, dropped connections, listing by app id,
CPU and memory requests, a sandbox's logs, and a create still in flight when dtrun cancels it."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
from grpclib import Status

from providers import errors as perr
from providers.base import Handle, LaunchRequest, NodeState, Offer
from providers.modal import ModalProvider, map_modal_error
from providers.modal.api import TORCH_INDEX, ModalAPI

from provider_fakes import modal_server

H100x8 = Offer("modal", "any", "H100", 8, False, 3.95)


@pytest.fixture
def modal(tmp_path, credentials, monkeypatch):
    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "dtrun-home"))
    server = modal_server()
    p = ModalProvider(ModalAPI(), home=tmp_path / "dtrun-home", confirm_wait_seconds=3.0, gpu_wait_seconds=1.5)
    yield server, p
    server.reset()


def _req(attempt: int = 1, **kw) -> LaunchRequest:
    return LaunchRequest(job="mj", attempt=attempt, offer=kw.pop("offer", H100x8), nodes=1,
                         command=["python", "infra/node_bootstrap.py"], env={"DTRUN_RUN_URI": "file:///tmp/r"}, **kw)


def _project(tmp_path, deps=('torch==2.13.0', 'numpy>=1.26')):
    proj = tmp_path / "proj"
    (proj / "pkg").mkdir(parents=True, exist_ok=True)
    (proj / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "0"\ndependencies = [' + ", ".join(f'"{d}"' for d in deps) + "]\n")
    (proj / "pkg" / "__init__.py").write_text("X = 1\n")
    return proj


# ---- 1. capacity ---------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_no_gpu_within_the_bounded_wait_is_no_capacity_and_nothing_is_left(modal):
    server, p = modal
    server.script.schedule = False  # Modal never finds an H100:8
    t = time.monotonic()
    with pytest.raises(perr.NoCapacity, match="Insufficient capacity"):
        p.launch(_req())
    assert time.monotonic() - t < 60  # the setting (1.5 s here), not Modal's 21 minutes
    (sb,) = server.sandboxes.values()
    assert sb.id in server.terminated  # the SDK terminated the unscheduled sandbox
    assert p.list_owned() == []


def test_the_sdks_insufficient_capacity_error_is_no_capacity():
    from modal.exception import ResourceExhaustedError

    e = map_modal_error(ResourceExhaustedError("Insufficient capacity to create sandbox."))
    assert type(e) is perr.NoCapacity
    assert type(map_modal_error(ResourceExhaustedError("rate limit: too many requests"))) is perr.Transient


def test_gpu_wait_is_a_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("DTRUN_MODAL_GPU_WAIT_SECONDS", "42")
    p = ModalProvider(ModalAPI(), home=tmp_path)
    assert p.sandbox_spec(_req()).gpu_wait == 42.0


# ---- 2. image: build failure, layers, torch build ------------------------------------------------

def test_a_failed_build_is_one_clear_error_with_the_real_message_and_the_logs_hint(modal, tmp_path):
    server, p = modal
    server.script.build_failure = ("Step 2/3 : RUN python -m pip install torch==2.13.0\n"
                                   "ERROR: Could not find a version that satisfies the requirement torch==2.13.0\n"
                                   "ERROR: No matching distribution found for torch==2.13.0")
    with pytest.raises(perr.ProviderError) as ei:
        p.launch(_req(workdir=str(_project(tmp_path))))
    e = ei.value
    assert isinstance(e, perr.NotSupported) and not isinstance(e, perr.Transient)  # not retried
    msg = str(e)
    assert "No matching distribution found for torch==2.13.0" in msg  # the build's real message
    assert "modal image logs im-" in msg                               # how to see the whole log
    assert "SandboxCreate" not in server.calls                          # nothing rented


def test_dependencies_are_layers_below_the_code_and_an_edit_rebuilds_only_the_code(modal, tmp_path):
    server, p = modal
    proj = _project(tmp_path)
    h = p.launch(_req(workdir=str(proj)))
    defs = [server.image_defs[i] for i in server.builds]
    cmds = ["\n".join(d.dockerfile_commands) for d in defs]
    torch_layer = next(i for i, c in enumerate(cmds) if "torch==2.13.0" in c)
    numpy_layer = next(i for i, c in enumerate(cmds) if "numpy>=1.26" in c)
    code_layer = next(i for i, d in enumerate(defs) if d.context_mount_id)
    assert torch_layer < numpy_layer < code_layer
    assert TORCH_INDEX in cmds[torch_layer]                      # the CUDA build for Modal's driver
    assert not defs[torch_layer].context_mount_id and not defs[numpy_layer].context_mount_id
    assert code_layer == len(defs) - 2 and "--no-deps" in cmds[-1]  # COPY, then install the code alone
    p.terminate(h)
    built = len(server.builds)
    (proj / "pkg" / "__init__.py").write_text("X = 2\n")  # a code edit
    p.terminate(p.launch(_req(attempt=2, workdir=str(proj))))
    new = ["\n".join(server.image_defs[i].dockerfile_commands) for i in server.builds[built:]]
    # only the two code layers were built again: nothing downloads torch or numpy
    assert len(new) == 2 and "COPY" in new[0] and "--no-deps" in new[1]
    assert not any("torch" in c or "numpy" in c for c in new)


def test_the_timeout_is_cut_to_the_deadline_after_the_build(modal):
    server, p = modal
    server.script.build_seconds = 1.5  # a slow first build
    h = p.launch(_req(deadline=time.time() + 20))
    d = server.sandboxes[h.instance_id].definition
    assert d.timeout_secs <= 18  # the build's seconds came off: Modal's kill lands by the deadline
    (env,) = [server.secrets[s] for s in d.secret_ids]
    # The node ends at the deadline: its watchdog's deadline check stops it (not a planned restart).
    assert "DTRUN_NODE_TIMEOUT_SECONDS" not in env and "DTRUN_DEADLINE" in env


def test_base_image_can_be_swapped(tmp_path):
    from providers.modal.api import build_image

    img = build_image(None, base_image="nvcr.io/nvidia/pytorch:25.01-py3")
    assert "from_registry" in repr(img) or "nvcr.io/nvidia/pytorch" in repr(img)


# ---- 4. abnormal endings ------------------------------------------------------------------------

@pytest.mark.parametrize("code,how,state,words", [
    (137, "oom", NodeState.FAILED, "out of memory"),
    (0, "eviction", NodeState.PREEMPTED, "evicted"),
    (0, "internal_failure", NodeState.PREEMPTED, "internal failure"),
    (124, "timeout", NodeState.PREEMPTED, "timeout"),
    (1, "init_failure", NodeState.FAILED, "failed to start"),
])
def test_the_result_status_decides_the_ending(modal, code, how, state, words):
    server, p = modal
    h = p.launch(_req())
    assert p.poll(h) is NodeState.RUNNING
    server.finish(h.instance_id, code, how)
    assert p.poll(h) is state
    assert words in (p.end_reason(h) or "")
    assert words in p.logs(h)  # `dtrun logs` and the failure report say why
    p.terminate(h)
    assert p.poll(h) is state


@pytest.mark.parametrize("code,state", [(3, NodeState.FAILED), (75, NodeState.PREEMPTED), (0, NodeState.SUCCEEDED)])
def test_a_node_that_ended_before_the_sdk_saw_it_is_read_not_refused(modal, code, state):
    server, p = modal
    server.script.finish_before_scheduled = (code, "success" if code == 0 else "failure")
    h = p.launch(_req())  # the SDK raised ConflictError("Sandbox already finished")
    assert h.instance_id in server.sandboxes
    assert p.poll(h) is state


# ---- 5. listing, collisions, vanished sandboxes, connections -------------------------------------

def test_the_sweep_lists_by_the_dtrun_apps_id(modal):
    server, p = modal
    h = p.launch(_req())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # modal's deprecation of environment-wide listing would raise
        owned = p.list_owned("dtrun-mj-")
    assert [o.instance_id for o in owned] == [h.instance_id]
    assert server.list_requests and all(r.app_id == server.apps["dtrun"] for r in server.list_requests)


def test_a_name_collision_reattaches_to_the_existing_sandbox(modal):
    server, p = modal
    h1 = p.launch(_req())
    h2 = p.launch(_req())  # the same attempt again (a retry after a dropped reply, a restarted controller)
    assert h2.instance_id == h1.instance_id and h2.data.get("reattached")
    assert len([s for s in server.sandboxes.values() if s.running]) == 1


def test_not_found_means_gone_and_is_never_transient(modal):
    from modal.exception import AlreadyExistsError, NotFoundError

    _, p = modal
    ghost = Handle("modal", "dtrun-mj-a9", "sb-" + "9" * 22)
    assert p.poll(ghost) is NodeState.PREEMPTED
    p.terminate(ghost)  # already gone: fine
    assert not isinstance(map_modal_error(NotFoundError("x")), perr.Transient)
    assert not isinstance(map_modal_error(AlreadyExistsError("x")), perr.Transient)


def test_dropped_connections_are_retried_by_the_sdk_then_transient(modal):
    server, p = modal
    h = p.launch(_req())
    server.fail_next("SandboxWait", Status.UNAVAILABLE, "connection reset", times=2)
    assert p.poll(h) is NodeState.RUNNING  # the SDK's own retries got through
    assert server.drop_connections() >= 1  # every TCP connection aborted
    assert p.poll(h) is NodeState.RUNNING
    server.fail_next("SandboxWait", Status.UNAVAILABLE, "connection reset", times=8)
    with pytest.raises(perr.Transient):
        p.poll(h)
    server.script.fail.clear()
    p.terminate(h)


# ---- 6. CPU and memory --------------------------------------------------------------------------

def test_cpu_and_memory_are_requested_per_gpu(modal):
    server, p = modal
    p.launch(_req(cpu_per_gpu=8.0, memory_gb_per_gpu=48.0))
    (sb,) = server.sandboxes.values()
    r = sb.definition.resources
    assert r.milli_cpu == 8 * 8 * 1000 and r.memory_mb == 48 * 8 * 1024
    assert r.gpu_config.count == 8


def test_the_spec_has_cpu_and_memory_per_gpu_with_trainer_defaults():
    from orchestrator.plan.spec import json_schema, parse_spec

    spec = parse_spec({"name": "mj", "resources": {"providers": ["modal"], "gpu": "H100", "gpus_per_node": 8},
                       "trainer": {"model": "tiny", "steps": 10, "batch_size": 8, "seq_len": 64}})
    assert spec.resources.cpu_per_gpu == 8.0 and spec.resources.memory_gb_per_gpu == 48.0
    props = json_schema()["$defs"]["Resources"]["properties"]
    assert "cpu_per_gpu" in props and "memory_gb_per_gpu" in props


# ---- the sandbox's output -----------------------------------------------------------------------

def test_logs_are_the_sandboxes_stdout_and_stderr(modal):
    server, p = modal
    h = p.launch(_req())
    server.write_output(h.instance_id, stdout="step 1 loss 3.2\n", stderr="Traceback: boom\n")
    server.finish(h.instance_id, 1)
    text = p.logs(h)
    assert "step 1 loss 3.2" in text and "Traceback: boom" in text


def test_a_running_sandboxes_output_is_readable_while_it_runs(modal):
    # `dtrun logs -f` polls this while the node trains: it read nothing until the sandbox ended
    # (the SDK's read blocks to EOF), found running the node for real in the Modal lab
    server, p = modal
    h = p.launch(_req())
    server.write_output(h.instance_id, stdout="step 3 loss 4.1\n", stderr="[dtrun-node] exec: torchrun\n")
    assert p.poll(h) is NodeState.RUNNING
    text = p.logs(h)
    assert "step 3 loss 4.1" in text and "[dtrun-node] exec: torchrun" in text
    assert p.poll(h) is NodeState.RUNNING


# ---- a create in flight (the controller runs launch off its loop) --------------------------------

@pytest.mark.timeout(120)
def test_terminate_and_list_work_while_a_create_is_in_flight(modal):
    server, p = modal
    p.gpu_wait_seconds = 30.0
    server.script.schedule = False  # the create waits for a GPU
    out: dict = {}

    def launch():
        try:
            out["handle"] = p.launch(_req())
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=launch)
    t.start()
    end = time.monotonic() + 20
    while not server.sandboxes and time.monotonic() < end:
        time.sleep(0.05)
    assert [o.name for o in p.list_owned("dtrun-mj-")] == ["dtrun-mj-a1"]
    p.terminate(Handle("modal", "dtrun-mj-a1", ""))  # cancel: by the deterministic name
    t.join(25)
    assert not t.is_alive()
    assert p.list_owned("dtrun-mj-") == []
    if "handle" in out:
        assert p.poll(out["handle"]) is NodeState.TERMINATED
    else:
        assert not isinstance(out["error"], perr.Transient)


def test_dtrun_logs_shows_a_modal_attempts_stdout_and_stderr(modal, tmp_path, capsys):
    from orchestrator.cli.jobs import cmd_logs
    from orchestrator.run.state import StateStore

    server, p = modal
    h = p.launch(_req())
    server.write_output(h.instance_id, stdout="step 7 loss 2.9\n", stderr="CUDA error: boom\n")
    server.finish(h.instance_id, 1)
    store = StateStore()  # under DTRUN_HOME
    store.create_job("mj", "name: mj\n", "file:///tmp/r", providers=["modal"], t=1.0)
    store.new_attempt("mj", 1, H100x8.to_dict(), "modal", 1.0,
                      log_path=str(tmp_path / "no-such-local-file.log"))  # a Modal attempt writes none
    store.add_node("mj", 1, h.to_dict(), 1.0)
    store.close()
    assert cmd_logs("mj", follow=False) == 0
    out = capsys.readouterr().out
    assert "step 7 loss 2.9" in out and "CUDA error: boom" in out


@pytest.mark.timeout(120)
def test_a_cancel_during_the_image_build_creates_nothing(modal, tmp_path):
    server, p = modal
    server.script.build_seconds = 0.5  # per layer
    out: dict = {}

    def launch():
        try:
            out["handle"] = p.launch(_req(workdir=str(_project(tmp_path))))
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=launch)
    t.start()
    end = time.monotonic() + 20
    while "ImageJoinStreaming" not in server.calls and time.monotonic() < end:
        time.sleep(0.02)
    p.terminate(Handle("modal", "dtrun-mj-a1", ""))  # nothing to find yet: remembered by name
    t.join(60)
    assert not t.is_alive()
    assert "handle" not in out and "cancelled" in str(out["error"])
    assert server.sandboxes == {}  # no sandbox was ever created


def test_the_sandbox_cap_and_restart_grace_are_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("DTRUN_MODAL_MAX_TIMEOUT_SECONDS", "290")
    monkeypatch.setenv("DTRUN_MODAL_RESTART_GRACE_SECONDS", "20")
    spec = ModalProvider(ModalAPI(), home=tmp_path).sandbox_spec(_req())
    assert spec.timeout == 290
    assert spec.env["DTRUN_NODE_TIMEOUT_SECONDS"] == "290" and spec.env["DTRUN_RESTART_GRACE_SECONDS"] == "20"
    monkeypatch.setenv("DTRUN_MODAL_MAX_TIMEOUT_SECONDS", "soon")
    with pytest.raises(perr.NotSupported, match="DTRUN_MODAL_MAX_TIMEOUT_SECONDS='soon'"):
        ModalProvider(ModalAPI(), home=tmp_path)
