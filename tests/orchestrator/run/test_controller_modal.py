"""The controller with Modal. (1) No GPU on Modal: through the real ``modal`` client against the
local fake control plane, the attempt is a capacity miss and the next offer is launched.
(2) A job longer than Modal's 24-hour sandbox cap, on a virtual clock: the real controller, the real
Modal adapter, the real node watchdog (``infra/node_bootstrap.Watchdog``) deciding when to stop.

Below the adapter is the recorded ``FakeModalAPI`` seam (no SDK: the clock is virtual and Modal's
control plane knows only real time), extended with what Modal does on its own: it kills a sandbox
``timeout`` seconds after it started (result status TIMEOUT, exit 124, work since the last
checkpoint lost). A simulated trainer plays the run-URI contract (progress, COMMITTED checkpoints,
STOP honoured with a checkpoint, DONE)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "infra"))

import node_bootstrap as nb  # noqa: E402
from provider_fakes import FakeModalAPI  # noqa: E402

from orchestrator.contract import runuri  # noqa: E402
from orchestrator.plan.estimate import make_plan  # noqa: E402
from orchestrator.plan.spec import parse_spec  # noqa: E402
from orchestrator.run.clock import VirtualClock  # noqa: E402
from orchestrator.run.controller import Controller  # noqa: E402
from orchestrator.run.state import StateStore  # noqa: E402
from providers.base import Offer  # noqa: E402
from providers.modal import ModalProvider  # noqa: E402

MODAL = Offer("modal", "any", "H100", 1, False, 4.0)
STEP_S = 100.0
STEPS = 1080          # × 100 s = 30 hours of training
EVERY = 50            # a checkpoint every 50 steps (~1.4 h)


class ModalWorld(FakeModalAPI):
    """Modal's side on the virtual clock: sandboxes start at once, end at their timeout (Modal) or
    when their node's watchdog stops them (the real Watchdog, from the sandbox's own env)."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock
        self.timeouts: list[str] = []      # sandboxes Modal killed at their timeout

    def create(self, spec, should_cancel=None, on_progress=None):
        sid = super().create(spec)
        env = {**spec.env, "DTRUN_WATCHDOG_SECONDS": "10"}
        sb = self.sandboxes[sid]
        sb.update(start=self.clock(), s0=None, wd=nb.Watchdog(nb.NodeConfig.from_env(env), start=self.clock(),
                                                              clock=self.clock))
        return sid

    def result(self, sandbox_id):
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None and sb["code"] is None:
            self._advance(sandbox_id, sb)
        return super().result(sandbox_id)

    def _advance(self, sid, sb):
        now = self.clock()
        spec = sb["spec"]
        uri = spec.env["DTRUN_RUN_URI"]
        attempt = int(spec.env["DTRUN_ATTEMPT"])
        if sb["s0"] is None:
            lc = runuri.latest_committed(uri)
            sb["s0"] = lc[0] if lc else 0
        end = min(now, sb["start"] + spec.timeout)
        step = min(STEPS, sb["s0"] + int((end - sb["start"]) / STEP_S))
        for k in range(sb["s0"] + 1, step + 1):
            if k % EVERY == 0 or k == STEPS:
                c = runuri.join(runuri.checkpoint_uri(uri, k), runuri.COMMITTED)
                if not runuri.exists(c):
                    runuri.write_json(c, {"step": k, "time": end})
        lc = runuri.latest_committed(uri)
        runuri.write_json(runuri.join(uri, runuri.PROGRESS),
                          {"step": step, "steps": STEPS, "loss": 2.0, "tokens_per_s": 1.0, "time": end,
                           "attempt": attempt, "last_committed_step": lc[0] if lc else None})
        if step >= STEPS:
            runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "time": end})
            self.exits(sid, 0)
            return
        if now >= sb["start"] + spec.timeout:  # Modal ends it: no checkpoint since the last one
            self.timeouts.append(sid)
            self.exits(sid, 124, "timeout")
            return
        wd = sb["wd"]
        if wd.reason is None:
            hit = wd.check(now)
            if hit:
                wd.record(*hit)  # watchdog.json + STOP, as on the node
        if runuri.exists(runuri.join(uri, runuri.STOP)):
            c = runuri.join(runuri.checkpoint_uri(uri, step), runuri.COMMITTED)  # the STOP checkpoint
            if not runuri.exists(c):
                runuri.write_json(c, {"step": step, "time": now})
            self.exits(sid, nb.EXIT_WATCHDOG if wd.reason else 0)


@pytest.fixture
def world(tmp_path, dtrun_home, monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_ID", "dummy-id")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "dummy-secret")
    clock = VirtualClock()
    api = ModalWorld(clock)
    provider = ModalProvider(api, home=dtrun_home, confirm_wait_seconds=0.0)
    store = StateStore(dtrun_home / "state.db")
    spec = parse_spec({
        "name": "long",
        "resources": {"providers": ["modal"], "gpu": "H100", "gpus_per_node": 1, "spot": False},
        "trainer": {"model": "tiny", "steps": STEPS, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": EVERY},
        "budget": {"max_usd": 1000.0},
        "recovery": {"poll_seconds": 60, "backoff_seconds": 10, "heartbeat_timeout_seconds": 900},
    })
    c = Controller(spec, store, clock=clock, providers={"modal": provider}, plan=make_plan(spec, offers=[MODAL]))
    yield dict(c=c, api=api, store=store, clock=clock)
    store.close()


def test_a_30_hour_job_on_modal_restarts_once_as_planned_and_loses_no_work(world):
    c, api, store = world["c"], world["api"], world["store"]
    t0 = world["clock"]()
    assert c.run() == "SUCCEEDED"
    job = store.get_job("long")
    assert job["step"] == STEPS
    atts = store.attempts("long")
    assert [a["outcome"] for a in atts[:-1]] == ["planned_restart"], [(a["outcome"], a["reason"]) for a in atts]
    assert api.timeouts == []                 # Modal never had to kill a sandbox at its 24 h cap
    assert (job["steps_lost"] or 0) == 0      # the planned checkpoint kept every step
    first = api.sandboxes["sb-0001"]
    assert first["spec"].timeout == 24 * 3600
    # it stopped within the restart grace of the cap, and the job took 30 h plus little
    assert 23 * 3600 < atts[0]["ended_at"] - first["start"] < 24 * 3600
    assert world["clock"]() - t0 < 30 * 3600 + 3600
    assert c.summary()["attempts"] == 2


def test_no_modal_gpu_moves_the_controller_to_the_next_offer(tmp_path, dtrun_home, monkeypatch):
    """Through the real modal client and the local fake control plane: Modal never schedules the
    sandbox; after the bounded wait the attempt is a capacity miss and the next launch is the next
    offer at once (not the same Modal offer again after a transient backoff)."""
    from provider_fakes import FakeSkyAPI, modal_server

    from providers.modal.api import ModalAPI
    from providers.skypilot import SkyPilotProvider

    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake")
    monkeypatch.setenv("RUNPOD_API_KEY", "dummy-runpod")
    server = modal_server()
    server.script.schedule = False
    sky = FakeSkyAPI()
    providers = {"modal": ModalProvider(ModalAPI(), home=dtrun_home, confirm_wait_seconds=2.0, gpu_wait_seconds=1.0),
                 "runpod": SkyPilotProvider("runpod", sky, home=dtrun_home)}
    runpod = Offer("runpod", "any", "H100", 1, False, 5.0)
    spec = parse_spec({
        "name": "cap",
        "resources": {"providers": ["modal", "runpod"], "gpu": "H100", "gpus_per_node": 1, "spot": False},
        "trainer": {"model": "tiny", "steps": 100, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": 10},
        "budget": {"max_usd": 100.0},
        "recovery": {"poll_seconds": 30, "backoff_seconds": 600},
    })
    store = StateStore(dtrun_home / "state.db")
    c = Controller(spec, store, clock=VirtualClock(), providers=providers,
                   plan=make_plan(spec, offers=[MODAL, runpod]))
    c.start()
    for _ in range(4):
        c.tick()
        if len(store.attempts("cap")) >= 2:
            break
    atts = store.attempts("cap")
    assert atts[0]["provider"] == "modal" and atts[0]["outcome"] == "no_capacity", atts[0]
    assert "Insufficient capacity" in atts[0]["reason"]
    assert atts[1]["provider"] == "runpod"
    assert [sb.id for sb in server.sandboxes.values()] == server.terminated  # nothing left on Modal
    store.request_action("cap", "stop_now")
    for _ in range(5):
        if c.tick() in ("CANCELLED", "FAILED"):
            break
    store.close()
    server.reset()


@pytest.mark.timeout(120)
def test_dtrun_down_during_a_modal_image_build_creates_no_sandbox(tmp_path, dtrun_home, monkeypatch):
    """Through the real modal client and the local fake control plane: `dtrun down` while the
    launch in flight is still building its image. Nothing exists to find by name yet; the
    controller must tell Modal the launch is cancelled (the adapter's cancel by name), so the
    build's end creates no GPU sandbox — not one that bills until the abandoned worker or the
    orphan sweep ends it (or, if this process exits first, until its timeout)."""
    import threading
    import time

    from provider_fakes import modal_server

    from providers.modal.api import ModalAPI

    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake")
    server = modal_server()
    server.script.build_seconds = 0.5  # per layer: the build outlasts the controller's stop grace
    provider = ModalProvider(ModalAPI(), home=dtrun_home, confirm_wait_seconds=2.0, gpu_wait_seconds=1.0)
    spec = parse_spec({
        "name": "mb",
        "resources": {"providers": ["modal"], "gpu": "H100", "gpus_per_node": 1, "spot": False},
        "trainer": {"model": "tiny", "steps": 100, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": 10},
        "budget": {"max_usd": 100.0},
        "recovery": {"poll_seconds": 30},
    })
    store = StateStore(dtrun_home / "state.db")
    c = Controller(spec, store, clock=VirtualClock(), providers={"modal": provider},
                   plan=make_plan(spec, offers=[MODAL]), write_lease=False, launch_wait_seconds=0.05)

    def on_tick(_c):
        end = time.monotonic() + 30
        while "ImageJoinStreaming" not in server.calls and time.monotonic() < end:
            time.sleep(0.02)
        assert "ImageJoinStreaming" in server.calls
        store.request_action("mb", "stop")

    try:
        assert c.run(on_tick=on_tick) == "CANCELLED"
        for t in threading.enumerate():
            if t.name.startswith("dtrun-launch-"):
                t.join(60.0)
        assert server.sandboxes == {}, "a GPU sandbox was created after `dtrun down`"
    finally:
        store.close()
        server.reset()


def test_a_modal_node_whose_timeout_is_the_deadline_stops_for_the_deadline_not_a_planned_restart(tmp_path):
    """budget.max_hours shorter than Modal's 24 h cap: the sandbox timeout is cut to the job's
    deadline, so the provider's end IS the deadline. The node's watchdog must stop for the deadline
    (OVER_BUDGET), not for a "planned restart" 20 min before it — that one is relaunched at once,
    uncounted, and each new sandbox (timeout < the restart grace) restarts again at its first check
    until the controller's deadline guard finally stops it: start-ups paid for nothing."""
    from providers.base import LaunchRequest

    now = 1_000_000.0
    deadline = now + 2 * 3600
    req = LaunchRequest(job="dl", attempt=1, offer=MODAL, nodes=1, command=["python", "infra/node_bootstrap.py"],
                        env={"DTRUN_RUN_URI": f"file://{tmp_path}/run", "DTRUN_DEADLINE": f"{deadline:.3f}"},
                        deadline=deadline)
    spec = ModalProvider(FakeModalAPI(), home=tmp_path).sandbox_spec(req, now=now)
    assert spec.timeout == 2 * 3600
    start = now + 120  # the container starts after the create (image pull, scheduling)
    wd = nb.Watchdog(nb.NodeConfig.from_env({**spec.env, "DTRUN_WATCHDOG_SECONDS": "10"}), start=start,
                     clock=lambda: start)
    t = start
    while (hit := wd.check(t)) is None and t < deadline:
        t += 10
    assert hit is not None and hit[0] == "deadline", hit


def test_an_evicted_modal_sandbox_is_a_preemption_that_says_why(world):
    # found running the node for real (tests/e2e/test_modal_lab.py): the attempt said only
    # "preempted"; Modal's result status (eviction) never reached the events or the attempt
    c, api, store, clock = world["c"], world["api"], world["store"], world["clock"]
    advance = api._advance

    def evict_first(sid, sb):
        if sid == "sb-0001" and clock() - sb["start"] > 3 * 3600:
            api.exits(sid, 137, "eviction")  # the platform took the container back
            return
        advance(sid, sb)
    api._advance = evict_first
    assert c.run() == "SUCCEEDED"
    first = store.attempts("long")[0]
    assert first["outcome"] == "preempted"
    assert "Modal evicted the sandbox" in first["reason"], first["reason"]


@pytest.mark.timeout(120)
def test_the_live_view_shows_which_image_layer_a_modal_launch_is_building(tmp_path, dtrun_home, monkeypatch):
    """Through the real modal client and the local fake control plane, each layer's build taking
    a while: the controller turns the adapter's build progress into `build` events and the live
    view's line reads "building image: layer k of n (what), N s elapsed"."""
    import time

    from provider_fakes import modal_server

    from orchestrator.cli.live import progress_line, snapshot
    from providers.modal.api import ModalAPI

    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake")
    server = modal_server()
    server.script.build_seconds = 0.4  # per layer
    provider = ModalProvider(ModalAPI(), home=dtrun_home, confirm_wait_seconds=2.0, gpu_wait_seconds=1.0)
    spec = parse_spec({
        "name": "ml",
        "resources": {"providers": ["modal"], "gpu": "H100", "gpus_per_node": 1, "spot": False},
        "trainer": {"model": "tiny", "steps": 100, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": 10},
        "budget": {"max_usd": 100.0},
        "recovery": {"poll_seconds": 30},
    })
    store = StateStore(dtrun_home / "state.db")
    c = Controller(spec, store, clock=VirtualClock(), providers={"modal": provider},
                   plan=make_plan(spec, offers=[MODAL]), write_lease=False, launch_wait_seconds=0.05)
    lines: list[str] = []

    def on_tick(_c):
        time.sleep(0.1)
        s = snapshot(store, "ml")
        if s["build"]:
            lines.append(progress_line(s))
        if s["state"] != "PROVISIONING" or (s["build"] or {}).get("layer", 0) >= 3:
            store.request_action("ml", "stop")

    try:
        assert c.run(on_tick=on_tick) == "CANCELLED"
        builds = [e for e in store.events("ml") if e["type"] == "build"]
        assert builds and builds[0]["message"].startswith("attempt 1: building image: layer 1 of ")
        n = builds[0]["data"]["layers"]
        assert n >= 4 and [e["data"]["layer"] for e in builds] == sorted(e["data"]["layer"] for e in builds)
        assert any(f"building image: layer " in ln and f" of {n} (" in ln and "elapsed" in ln for ln in lines), lines
    finally:
        store.close()
        server.reset()
