"""Modal through its SDK (SkyPilot has no Modal cloud): one attempt = one Sandbox.

* **Launch** (blocks: run it off the controller's loop): the node image is built first, in layers
  (``api.build_image``: base → torch from the CUDA build for Modal's driver → the project's other
  declared dependencies → the code, ``pip install --no-deps -e .``), so a code edit rebuilds only
  the top; then ``modal.Sandbox.create(<bootstrap argv>, app=App "dtrun", name=<instance name>,
  gpu="H100:8", cpu=<cores per GPU × GPUs>, memory=<MiB>, timeout=<to the deadline, cut after the
  build, at most 24 h>, tags={"dtrun": "1", "dtrun_job": …, "dtrun_name": …},
  secrets=[modal.Secret.from_dict(request.secrets)])``. The SDK waits for a GPU at most
  ``gpu_wait_seconds`` (``DTRUN_MODAL_GPU_WAIT_SECONDS``, default 300; Modal's own is 21 min), then
  terminates the unscheduled sandbox and raises "Insufficient capacity" → ``NoCapacity`` (next
  offer). A failed build → :class:`ImageBuildFailed` (the build's message, its last log lines and
  ``modal image logs <id>``; not retried). The name already taken → re-attach to that sandbox;
  ``ConflictError("Sandbox already finished")`` → the sandbox is found by name and its result read.
* **24-hour cap**: the node gets ``DTRUN_NODE_TIMEOUT_SECONDS`` (the sandbox's timeout) and
  ``DTRUN_RESTART_GRACE_SECONDS``; its watchdog checkpoints and exits "resume me" (76, reason
  ``restart``) that long before Modal's kill, and the controller relaunches as a planned restart.
* **Poll**: the sandbox's result *status*, not only its exit code: running → RUNNING; kernel OOM
  kill / memory thrashing / init failure → FAILED (the reason in :meth:`end_reason` and ``logs``);
  eviction, internal failure, timeout → PREEMPTED; otherwise the code: 0 → SUCCEEDED; 75/76 →
  PREEMPTED; 137 (terminated) → TERMINATED if dtrun terminated it, else PREEMPTED; other → FAILED;
  unknown id (NotFound) → gone: TERMINATED if ours, else PREEMPTED.
* **Terminate**: ``sandbox.terminate()``; finished or unknown is fine; confirmed when the result
  is there. A handle with no sandbox id (a create still in flight) is found by its name.
* **list_owned**: ``Sandbox.list(app_id=<the dtrun app's id>, tags={"dtrun": "1"})`` by name prefix.
* **Errors**: only connection-level faults (ConnectionError, ServiceError/UNAVAILABLE, InternalError,
  OSError) are ``Transient``; NotFound, AlreadyExists, Conflict are handled where they mean
  something and never retried blindly.

Every SDK call goes through :class:`providers.modal.api.ModalAPI`; tests drive it through the real
SDK against a local fake control plane (tests/fakes/fake_modal_server.py). Credentials:
``MODAL_TOKEN_ID`` + ``MODAL_TOKEN_SECRET``, or ``~/.modal.toml`` (``modal token set``;
``MODAL_CONFIG_PATH`` moves it).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from providers import errors as perr
from providers import pricing
from providers._jsonstore import dtrun_home, locked_json
from providers.base import (
    PREEMPT_EXIT_CODES,
    NAME_PREFIX,
    Capabilities,
    Capability,
    Handle,
    LaunchRequest,
    NodeState,
    Offer,
    OwnedInstance,
    Provider,
    Requirements,
)
from providers.modal.api import (DEFAULT_GPU_WAIT, BuildFailed, Cancelled, DeadlinePassed, ModalAPI,
                                 SandboxRecord, SandboxResult, SandboxSpec)

MAX_TIMEOUT = 24 * 3600
"""Modal's cap on a sandbox's timeout (``DTRUN_MODAL_MAX_TIMEOUT_SECONDS`` lowers it: shorter
sandboxes, planned restarts sooner)."""
RESTART_GRACE = 20 * 60
"""Seconds before the sandbox's own timeout at which the node stops for a planned restart: the
checkpoint (STOP, then SIGTERM/SIGKILL graces) must fit, and the scheduling wait if Modal counts the
timeout from the create call rather than the container's start."""
TAG = {"dtrun": "1"}

# dtrun GPU name -> Modal's gpu string.
MODAL_GPUS = {"H100": "H100", "H200": "H200", "B200": "B200", "A100-80GB": "A100-80GB", "A100": "A100-40GB",
              "L40S": "L40S", "L4": "L4", "A10": "A10G", "T4": "T4"}

_AUTH = {"AuthError", "PermissionDeniedError"}
# Only a connection-level fault is worth retrying as is. Every Modal error subclasses grpclib's
# GRPCError, so the class name decides, never the base.
_TRANSIENT = {"ConnectionError", "InternalError", "ServiceError", "InternalFailure", "StreamTerminatedError",
              "OSError", "TimeoutError", "ConnectionRefusedError", "ConnectionResetError"}
_UNSUPPORTED = {"InvalidError", "UnimplementedError", "VersionError"}
_QUOTA_RE = re.compile(r"quota|spend(ing)? limit|billing|limit exceeded|credits", re.I)
_CAPACITY_RE = re.compile(r"capacity|no .*gpus? (are )?available", re.I)
_ALREADY_FINISHED_RE = re.compile(r"already finished|already completed|already terminated", re.I)

# A finished sandbox's result status (modal_proto GenericResult) → (state, reason or None).
_RESULT_STATES = {
    "oom": (NodeState.FAILED, "out of memory: the kernel OOM-killed the sandbox (raise resources.memory_gb_per_gpu)"),
    "thrashing": (NodeState.FAILED, "out of memory: Modal evicted the sandbox for memory thrashing "
                                    "(raise resources.memory_gb_per_gpu)"),
    "init_failure": (NodeState.FAILED, "the sandbox failed to start (image or command)"),
    "eviction": (NodeState.PREEMPTED, "Modal evicted the sandbox (memory manager)"),
    "internal_failure": (NodeState.PREEMPTED, "Modal internal failure"),
    "timeout": (NodeState.PREEMPTED, "the sandbox reached its timeout"),
    "idle_timeout": (NodeState.PREEMPTED, "the sandbox reached its idle timeout"),
}


def _env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment (``default`` when unset); a bad value is
    one clear error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return float(default)
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if v <= 0:
        raise perr.NotSupported(f"{name}={raw!r}: expected a positive number of seconds", provider="modal")
    return v


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def map_modal_error(e: BaseException) -> perr.ProviderError:
    """Modal's exception → dtrun's provider error (by class name: no modal import needed)."""
    if isinstance(e, perr.ProviderError):
        return e
    names = _names(e)
    full = str(e).strip()
    text = full.splitlines()[0] if full else ""
    msg = f"modal: {type(e).__name__}: {text}"
    if isinstance(e, BuildFailed):
        return ImageBuildFailed(e)
    if isinstance(e, Cancelled):
        return perr.ProviderError(f"modal: {e}", provider="modal")
    if isinstance(e, DeadlinePassed):
        return perr.NotSupported(f"modal: {e}", provider="modal")
    if names & _AUTH:
        return perr.AuthError(msg + " (check MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or ~/.modal.toml)", provider="modal")
    if "ResourceExhaustedError" in names:
        if _QUOTA_RE.search(full):
            return perr.QuotaExceeded(msg, provider="modal")
        if _CAPACITY_RE.search(full):  # Sandbox.create's scheduling wait ran out: no GPU now
            return perr.NoCapacity(msg, provider="modal")
        return perr.Transient(msg + " (rate limited)", provider="modal")
    if _QUOTA_RE.search(full):
        return perr.QuotaExceeded(msg, provider="modal")
    if names & {"AlreadyExistsError", "NotFoundError", "ConflictError"}:
        # The adapter handles these where they mean something (re-attach, gone, finished);
        # anywhere else they are a decision, not a passing fault.
        return perr.ProviderError(msg, provider="modal")
    if names & _UNSUPPORTED:
        return perr.NotSupported(msg, provider="modal")
    if names & _TRANSIENT:
        return perr.Transient(msg, provider="modal")
    if _CAPACITY_RE.search(full):
        return perr.NoCapacity(msg, provider="modal")
    return perr.ProviderError(msg, provider="modal")


class ImageBuildFailed(perr.NotSupported):
    """The node image did not build: the build's own message, the last log lines, and how to see
    the whole log. Not transient (the same image fails the same way on every Modal offer)."""

    def __init__(self, e: BuildFailed) -> None:
        tail = "\n".join(e.logs.splitlines()[-15:])
        hint = f"full build log: modal image logs {e.image_id}" if e.image_id else ""
        parts = [f"modal: the node image failed to build: {str(e).strip()}"]
        if tail and tail not in str(e):
            parts.append(f"last build log lines:\n{tail}")
        if hint and hint.split(": ", 1)[1] not in str(e):
            parts.append(hint)
        super().__init__("\n".join(parts), provider="modal")
        self.image_id = e.image_id


def modal_config_problem(path: Path) -> str | None:
    """Why the Modal client could not take a token from ``path`` (``~/.modal.toml``), or None:
    it must be TOML with a profile holding ``token_id`` and ``token_secret`` — the active one
    (``active = true``, or ``MODAL_PROFILE``), or the only one."""
    import tomllib

    try:
        with path.open("rb") as f:
            cfg = tomllib.load(f)
    except (OSError, ValueError) as e:
        return f"{path} is not a valid TOML file ({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})"
    profiles = {k: v for k, v in cfg.items() if isinstance(v, dict)}
    want = os.environ.get("MODAL_PROFILE") or next((k for k, v in profiles.items() if v.get("active") is True), None)
    if want is None and len(profiles) == 1:
        want = next(iter(profiles))
    prof = profiles.get(want or "default")
    if prof is None:
        return f"{path} has no active profile with a token (run `modal token set`)"
    if not str(prof.get("token_id") or "").strip() or not str(prof.get("token_secret") or "").strip():
        return f"{path}: profile [{want or 'default'}] has no token_id/token_secret"
    return None


class ModalProvider(Provider):
    name = "modal"

    def __init__(self, api: ModalAPI | None = None, *, home: str | os.PathLike[str] | None = None,
                 confirm_wait_seconds: float = 10.0, gpu_wait_seconds: float | None = None,
                 restart_grace_seconds: float | None = None, max_timeout_seconds: float | None = None) -> None:
        self.api = api if api is not None else ModalAPI()
        self._home = Path(home) if home is not None else None
        self.confirm_wait_seconds = confirm_wait_seconds
        self.gpu_wait_seconds = (gpu_wait_seconds if gpu_wait_seconds is not None
                                 else _env_seconds("DTRUN_MODAL_GPU_WAIT_SECONDS", DEFAULT_GPU_WAIT))
        self.restart_grace_seconds = (restart_grace_seconds if restart_grace_seconds is not None
                                      else _env_seconds("DTRUN_MODAL_RESTART_GRACE_SECONDS", RESTART_GRACE))
        self.max_timeout_seconds = int(max_timeout_seconds if max_timeout_seconds is not None
                                       else _env_seconds("DTRUN_MODAL_MAX_TIMEOUT_SECONDS", MAX_TIMEOUT))

    @property
    def _memo_path(self) -> Path:
        return (self._home or dtrun_home()) / "modal" / "sandboxes.json"

    def _memo(self, key: str, **update: Any) -> dict[str, Any]:
        with locked_json(self._memo_path) as data:
            rec = data.setdefault(key, {})
            rec.update(update)
            return dict(rec)

    def _terminated(self, sid: str, name: str) -> bool:
        return bool(self._memo(sid).get("terminated"))

    def capabilities(self) -> Capabilities:
        return Capabilities(
            spot=Capability(False, "Modal sells no spot sandboxes (they are preempted only when a "
                                   "region or cloud is pinned)"),
            multi_node=Capability(False, "a Modal sandbox is one container; dtrun does not use Modal clusters"),
            max_gpus_per_node=8,
        )

    def check_credentials(self) -> None:
        if os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET"):
            return
        cfg = Path(os.environ.get("MODAL_CONFIG_PATH") or "~/.modal.toml").expanduser()
        why = modal_config_problem(cfg) if cfg.is_file() else f"{cfg} does not exist"
        if why is None:
            return
        raise perr.AuthError(f"no Modal credentials: {why}; set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET, or run "
                             "`modal token set` (writes ~/.modal.toml)", provider="modal")

    def refuse(self, req: Requirements) -> str | None:
        if req.gpu not in MODAL_GPUS:
            return f"Modal has no {req.gpu} GPUs (has: {', '.join(MODAL_GPUS)})"
        return super().refuse(req)

    def offers(self, req: Requirements) -> list[Offer]:
        if self.refuse(req) is not None:
            return []
        return [o for o in pricing.offers("modal", req) if o.provider == "modal" and not o.spot
                and (req.max_price_per_gpu_hour is None or o.price_per_gpu_hour <= req.max_price_per_gpu_hour)]

    def sandbox_spec(self, request: LaunchRequest, now: float | None = None) -> SandboxSpec:
        offer = request.offer
        now = time.time() if now is None else now
        timeout = self.max_timeout_seconds
        if request.deadline is not None:
            timeout = int(request.deadline - now)
            if timeout <= 0:
                raise perr.NotSupported(f"{request.instance_name}: the hard deadline has already passed",
                                        provider="modal")
        timeout = min(self.max_timeout_seconds, timeout)
        env = {k: str(v) for k, v in request.env.items()}
        env.setdefault("DTRUN_JOB", request.job)
        env.setdefault("DTRUN_ATTEMPT", str(request.attempt))
        env.setdefault("DTRUN_NPROC_PER_NODE", str(offer.gpus_per_node))
        if request.deadline is not None:
            env.setdefault("DTRUN_DEADLINE", str(int(request.deadline)))
        # The node's watchdog stops for a planned restart this long before Modal's own timeout
        # (infra/node_bootstrap.py: DTRUN_NODE_TIMEOUT_SECONDS counted from the node's start).
        # Only when that timeout is Modal's cap: one cut to the job's deadline ends the node at the
        # deadline, which the node's deadline check already stops for (a planned restart there
        # would relaunch, uncounted, a sandbox too short to train — again and again).
        if request.deadline is None or timeout < int(request.deadline - now):
            env["DTRUN_NODE_TIMEOUT_SECONDS"] = str(timeout)
            env["DTRUN_RESTART_GRACE_SECONDS"] = f"{self.restart_grace_seconds:g}"
        gpus = offer.gpus_per_node
        cpu = request.cpu_per_gpu * gpus if request.cpu_per_gpu else None
        mem = int(request.memory_gb_per_gpu * gpus * 1024) if request.memory_gb_per_gpu else None
        return SandboxSpec(
            name=request.instance_name, command=list(request.command), env=env,
            gpu=f"{MODAL_GPUS[offer.gpu]}:{gpus}", timeout=timeout,
            tags={**TAG, "dtrun_job": request.job, "dtrun_name": request.instance_name,
                  **({"dtrun_owner": request.owner} if request.owner else {})},
            region=None if offer.region in ("", "any") else offer.region, workdir=request.workdir,
            cpu=cpu, memory_mb=mem, base_image=getattr(request, "image", None), gpu_wait=self.gpu_wait_seconds,
            deadline=request.deadline,
            secrets=dict(request.secrets),
        )

    def _handle(self, spec: SandboxSpec, sid: str, offer: Offer, **extra: Any) -> Handle:
        self._memo(sid, name=spec.name, terminated=self._terminated(sid, spec.name))  # keep a cancel's mark
        return Handle(provider="modal", name=spec.name, instance_id=sid, region=offer.region,
                      launched_at=time.time(),
                      data={"sandbox_id": sid, "gpu": spec.gpu, "timeout": spec.timeout, **extra})

    def launch(self, request: LaunchRequest) -> Handle:
        """Build the image (cached layers), create the sandbox, wait for a GPU at most
        ``gpu_wait_seconds``. Blocks for that long: run it off the controller's loop. While it
        blocks, ``terminate`` (by the deterministic name) and ``list_owned`` work."""
        offer = request.offer
        reason = self.refuse(Requirements(gpu=offer.gpu, gpus_per_node=offer.gpus_per_node,
                                          nodes=request.nodes, spot=offer.spot))
        if reason:
            raise perr.NotSupported(reason, provider="modal")
        self.check_credentials()
        spec = self.sandbox_spec(request)
        self._memo("name:" + spec.name, terminated=False)  # set by a terminate() while this runs
        h = self._create(spec, offer, request.on_progress)
        if self._memo("name:" + spec.name).get("terminated"):
            # cancelled while the create was in flight (terminate by name found nothing yet)
            self._memo(h.instance_id, terminated=True)
            self.terminate(h)
        return h

    def _create(self, spec: SandboxSpec, offer: Offer, on_progress: Any = None) -> Handle:
        def cancelled() -> bool:
            return bool(self._memo("name:" + spec.name).get("terminated"))

        try:
            sid = self.api.create(spec, should_cancel=cancelled, on_progress=on_progress)
        except Exception as e:
            names = _names(e)
            if "AlreadyExistsError" in names:
                # The name is taken: an earlier create of this very attempt got through (a retry
                # after a dropped connection, a controller restarted mid-launch). Re-attach to it.
                sid = self._find(spec.name, e)
                return self._handle(spec, sid, offer, reattached=True)
            if "ConflictError" in names and _ALREADY_FINISHED_RE.search(str(e)):
                # The node ended before the SDK saw its task: the sandbox exists and has a result.
                sid = self._find(spec.name, e)
                return self._handle(spec, sid, offer, finished_at_create=True)
            raise map_modal_error(e) from None
        return self._handle(spec, sid, offer)

    def _find(self, name: str, cause: BaseException) -> str:
        try:
            return self.api.find(name)
        except Exception as e:
            if "NotFoundError" in _names(e):
                raise perr.Transient(f"modal: {type(cause).__name__} for {name}, but no such sandbox now: "
                                     f"{str(cause).strip()}", provider="modal") from None
            raise map_modal_error(e) from None

    def result(self, handle: Handle) -> SandboxResult | None:
        """The sandbox's result as Modal reports it (None: Modal no longer knows it)."""
        try:
            return self.api.result(handle.instance_id)
        except Exception as e:
            if "NotFoundError" in _names(e):
                return None
            raise map_modal_error(e) from None

    def poll(self, handle: Handle) -> NodeState:
        sid = handle.instance_id
        res = self.result(handle)
        terminated = self._terminated(sid, handle.name)
        if res is None:  # gone
            return NodeState.TERMINATED if terminated else NodeState.PREEMPTED
        if res.running:
            return NodeState.RUNNING
        if res.status in _RESULT_STATES:
            state, _ = _RESULT_STATES[res.status]
            return NodeState.TERMINATED if terminated and state is NodeState.PREEMPTED else state
        code = res.exitcode
        if res.status == "terminated" or code == 137:
            return NodeState.TERMINATED if terminated else NodeState.PREEMPTED
        if code == 0:
            return NodeState.SUCCEEDED
        if code in PREEMPT_EXIT_CODES or code == 124:
            return NodeState.TERMINATED if terminated else NodeState.PREEMPTED
        return NodeState.FAILED

    def end_reason(self, handle: Handle) -> str | None:
        """Why a finished sandbox ended, in words (OOM, eviction, timeout…), or None."""
        res = self.result(handle)
        if res is None or res.running:
            return None
        if res.status in _RESULT_STATES:
            return _RESULT_STATES[res.status][1] + (f": {res.exception}" if res.exception else "")
        return res.exception or None

    def terminate(self, handle: Handle) -> None:
        """Idempotent. A handle without a sandbox id (a launch still in flight) is found by its
        deterministic name; the name is remembered so the launch, when it returns, reads as ours."""
        sid = handle.instance_id
        if not sid:
            self._memo("name:" + handle.name, terminated=True)
            try:
                sid = self.api.find(handle.name)
            except Exception as e:
                if "NotFoundError" in _names(e):
                    return  # not created (yet): the name memo makes a late one read as ours
                raise map_modal_error(e) from None
        res = self.result(Handle("modal", handle.name, sid))
        if res is None or not res.running:
            return  # already finished (keep its outcome) or gone
        self._memo(sid, name=handle.name, terminated=True)
        try:
            self.api.terminate(sid)
        except Exception as e:
            if "NotFoundError" in _names(e):
                return
            raise map_modal_error(e) from None
        deadline = time.monotonic() + self.confirm_wait_seconds
        while True:
            res = self.result(Handle("modal", handle.name, sid))
            if res is None or not res.running:
                return
            if time.monotonic() >= deadline:
                raise perr.TerminateNotConfirmed(f"{handle.name} ({sid}): terminate sent, still running",
                                                 provider="modal")
            time.sleep(0.5)

    def cancel_launch(self, name: str) -> None:
        """A launch of ``name`` in flight is cancelled: the create after the build is skipped
        (a sandbox already created is listed by ``list_owned`` and terminated by the caller)."""
        self._memo("name:" + name, terminated=True)

    def list_owned(self, prefix: str = NAME_PREFIX) -> list[OwnedInstance]:
        """Running sandboxes of the ``dtrun`` app (listed by its app id) named with ``prefix``."""
        try:
            recs: list[SandboxRecord] = self.api.list(dict(TAG))
        except Exception as e:
            raise map_modal_error(e) from None
        return [OwnedInstance(r.name, r.id, NodeState.RUNNING, "", owner=(r.tags or {}).get("dtrun_owner"))
                for r in recs if r.name.startswith(prefix)]

    def logs(self, handle: Handle, tail: int = 200) -> str:
        """The sandbox's stdout and stderr; the end reason first when Modal gave one (OOM…)."""
        try:
            text = self.api.logs(handle.instance_id, tail)
        except Exception as e:
            return f"(logs unavailable: {map_modal_error(e)})"
        try:
            why = self.end_reason(handle)
        except perr.ProviderError:
            why = None
        return (f"[modal] {why}\n" if why else "") + text


__all__ = ["ModalProvider", "ModalAPI", "SandboxSpec", "SandboxRecord", "SandboxResult", "ImageBuildFailed",
           "map_modal_error"]
