"""Modal through its SDK (SkyPilot has no Modal cloud): one attempt = one Sandbox.

* **Launch**: ``modal.Sandbox.create(<node bootstrap argv>, gpu="H100:8", timeout=<seconds to
  the hard deadline, at most 24 h>, image=<debian-slim + the project pip-installed>,
  app=App "dtrun", name=<instance name>, tags={"dtrun": "1", "dtrun_job": …, "dtrun_name": …},
  secrets=[modal.Secret.from_dict(request.secrets)])`` (the AWS keys for an ``s3://`` run URI:
  an ephemeral Modal secret, never in ``env``, the memo file or the handle).
  The sandbox ends when its command exits (the node removes itself) or at ``timeout``.
* **Poll**: ``sandbox.poll()``: None → RUNNING; 0 → SUCCEEDED; 75/76 → PREEMPTED; 137
  (terminated) → TERMINATED if dtrun terminated it, else PREEMPTED (Modal took it);
  124 (timeout: the hard deadline) → PREEMPTED (the controller decides from its own deadline);
  other → FAILED; unknown id → TERMINATED if ours, else PREEMPTED.
* **Terminate**: ``sandbox.terminate()``; a sandbox already finished or unknown is fine;
  confirmed when ``poll()`` returns an exit code.
* **list_owned**: ``Sandbox.list(tags={"dtrun": "1"})`` filtered by name prefix.

Every SDK call goes through :class:`providers.modal.api.ModalAPI` (tests use a fake). Credentials:
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
from providers.modal.api import ModalAPI, SandboxRecord, SandboxSpec

MAX_TIMEOUT = 24 * 3600
DEFAULT_TIMEOUT = 24 * 3600
TAG = {"dtrun": "1"}

# dtrun GPU name -> Modal's gpu string.
MODAL_GPUS = {"H100": "H100", "H200": "H200", "B200": "B200", "A100-80GB": "A100-80GB", "A100": "A100-40GB",
              "L40S": "L40S", "L4": "L4", "A10": "A10G", "T4": "T4"}

_AUTH = {"AuthError", "PermissionDeniedError"}
_TRANSIENT = {"ConnectionError", "InternalError", "ServiceError", "InternalFailure", "StreamTerminatedError",
              "GRPCError", "OSError", "TimeoutError"}
_UNSUPPORTED = {"InvalidError", "UnimplementedError", "VersionError"}
_QUOTA_RE = re.compile(r"quota|spend(ing)? limit|billing|limit exceeded|credits", re.I)
_CAPACITY_RE = re.compile(r"capacity|no .*gpus? (are )?available", re.I)


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def map_modal_error(e: BaseException) -> perr.ProviderError:
    """Modal's exception → dtrun's provider error (by class name: no modal import needed)."""
    if isinstance(e, perr.ProviderError):
        return e
    names = _names(e)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    msg = f"modal: {type(e).__name__}: {text}"
    if names & _AUTH:
        return perr.AuthError(msg + " (check MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or ~/.modal.toml)", provider="modal")
    if "ResourceExhaustedError" in names:
        if _QUOTA_RE.search(str(e)):
            return perr.QuotaExceeded(msg, provider="modal")
        return perr.Transient(msg + " (rate limited)", provider="modal")
    if _QUOTA_RE.search(str(e)):
        return perr.QuotaExceeded(msg, provider="modal")
    if names & _UNSUPPORTED:  # before transient: Modal's typed errors also subclass grpclib's GRPCError
        return perr.NotSupported(msg, provider="modal")
    if names & _TRANSIENT:
        return perr.Transient(msg, provider="modal")
    if _CAPACITY_RE.search(str(e)):
        return perr.NoCapacity(msg, provider="modal")
    return perr.ProviderError(msg, provider="modal")


class ModalProvider(Provider):
    name = "modal"

    def __init__(self, api: ModalAPI | None = None, *, home: str | os.PathLike[str] | None = None,
                 confirm_wait_seconds: float = 10.0) -> None:
        self.api = api if api is not None else ModalAPI()
        self._home = Path(home) if home is not None else None
        self.confirm_wait_seconds = confirm_wait_seconds

    @property
    def _memo_path(self) -> Path:
        return (self._home or dtrun_home()) / "modal" / "sandboxes.json"

    def _memo(self, sid: str, **update: Any) -> dict[str, Any]:
        with locked_json(self._memo_path) as data:
            rec = data.setdefault(sid, {})
            rec.update(update)
            return dict(rec)

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
        if cfg.is_file():
            return
        raise perr.AuthError("no Modal credentials: set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET, or run "
                             "`modal token set` (writes ~/.modal.toml)", provider="modal")

    def refuse(self, req: Requirements) -> str | None:
        if req.gpu not in MODAL_GPUS:
            return f"Modal has no {req.gpu} GPUs (has: {', '.join(MODAL_GPUS)})"
        return super().refuse(req)

    def offers(self, req: Requirements) -> list[Offer]:
        if self.refuse(req) is not None:
            return []
        from providers.catalog import catalog_offers

        return [o for o in catalog_offers("modal", req) if o.provider == "modal" and not o.spot
                and (req.max_price_per_gpu_hour is None or o.price_per_gpu_hour <= req.max_price_per_gpu_hour)]

    def sandbox_spec(self, request: LaunchRequest, now: float | None = None) -> SandboxSpec:
        offer = request.offer
        now = time.time() if now is None else now
        timeout = DEFAULT_TIMEOUT
        if request.deadline is not None:
            timeout = int(request.deadline - now)
            if timeout <= 0:
                raise perr.NotSupported(f"{request.instance_name}: the hard deadline has already passed",
                                        provider="modal")
        env = {k: str(v) for k, v in request.env.items()}
        env.setdefault("DTRUN_JOB", request.job)
        env.setdefault("DTRUN_ATTEMPT", str(request.attempt))
        env.setdefault("DTRUN_NPROC_PER_NODE", str(offer.gpus_per_node))
        if request.deadline is not None:
            env.setdefault("DTRUN_DEADLINE", str(int(request.deadline)))
        return SandboxSpec(
            name=request.instance_name, command=list(request.command), env=env,
            gpu=f"{MODAL_GPUS[offer.gpu]}:{offer.gpus_per_node}", timeout=min(MAX_TIMEOUT, timeout),
            tags={**TAG, "dtrun_job": request.job, "dtrun_name": request.instance_name},
            region=None if offer.region in ("", "any") else offer.region, workdir=request.workdir,
            secrets=dict(request.secrets),
        )

    def launch(self, request: LaunchRequest) -> Handle:
        offer = request.offer
        reason = self.refuse(Requirements(gpu=offer.gpu, gpus_per_node=offer.gpus_per_node,
                                          nodes=request.nodes, spot=offer.spot))
        if reason:
            raise perr.NotSupported(reason, provider="modal")
        self.check_credentials()
        spec = self.sandbox_spec(request)
        try:
            sid = self.api.create(spec)
        except Exception as e:
            raise map_modal_error(e) from None
        self._memo(sid, name=spec.name, terminated=False)
        return Handle(provider="modal", name=spec.name, instance_id=sid, region=offer.region,
                      launched_at=time.time(), data={"sandbox_id": sid, "gpu": spec.gpu, "timeout": spec.timeout})

    def poll(self, handle: Handle) -> NodeState:
        sid = handle.instance_id
        try:
            code = self.api.poll(sid)
        except Exception as e:
            if "NotFoundError" in _names(e):
                return NodeState.TERMINATED if self._memo(sid).get("terminated") else NodeState.PREEMPTED
            raise map_modal_error(e) from None
        if code is None:
            return NodeState.RUNNING
        terminated = bool(self._memo(sid).get("terminated"))
        if code == 0:
            return NodeState.SUCCEEDED
        if code in PREEMPT_EXIT_CODES or code == 124:
            return NodeState.TERMINATED if terminated else NodeState.PREEMPTED
        if code == 137:
            return NodeState.TERMINATED if terminated else NodeState.PREEMPTED
        return NodeState.FAILED

    def terminate(self, handle: Handle) -> None:
        sid = handle.instance_id
        try:
            if self.api.poll(sid) is not None:
                return  # already finished: keep its outcome
        except Exception as e:
            if "NotFoundError" in _names(e):
                return  # already gone
            raise map_modal_error(e) from None
        self._memo(sid, terminated=True)
        try:
            self.api.terminate(sid)
        except Exception as e:
            if "NotFoundError" in _names(e):
                return  # already gone
            raise map_modal_error(e) from None
        deadline = time.monotonic() + self.confirm_wait_seconds
        while True:
            try:
                if self.api.poll(sid) is not None:
                    return
            except Exception as e:
                if "NotFoundError" in _names(e):
                    return
                raise map_modal_error(e) from None
            if time.monotonic() >= deadline:
                raise perr.TerminateNotConfirmed(f"{handle.name} ({sid}): terminate sent, still running",
                                                 provider="modal")
            time.sleep(0.5)

    def list_owned(self, prefix: str = NAME_PREFIX) -> list[OwnedInstance]:
        try:
            recs: list[SandboxRecord] = self.api.list(dict(TAG))
        except Exception as e:
            raise map_modal_error(e) from None
        return [OwnedInstance(r.name, r.id, NodeState.RUNNING, "") for r in recs if r.name.startswith(prefix)]

    def logs(self, handle: Handle, tail: int = 200) -> str:
        try:
            return self.api.logs(handle.instance_id, tail)
        except Exception as e:
            return f"(logs unavailable: {map_modal_error(e)})"


__all__ = ["ModalProvider", "ModalAPI", "SandboxSpec", "SandboxRecord", "map_modal_error"]
