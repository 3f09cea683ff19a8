"""A local fake of Modal's control plane, for tests: the real ``modal`` client talks to it.

Modal's client speaks gRPC (grpclib) to ``MODAL_SERVER_URL``; the ``modal_proto`` package shipped
with modal 1.6.4 carries the service definition (``ModalClientBase``). This module serves the calls
dtrun makes — client hello, app get-or-create, image get-or-create + build log streaming, mounts
(inline files), secrets, sandbox create / get-task-id / wait / terminate / list / tags / from-name /
logs — from an in-process servicer on 127.0.0.1, so the real SDK code runs: its request building,
serialization, retries, and its exception classes from gRPC status codes. Every other call
answers UNIMPLEMENTED (``modal._utils.grpc_testing.patch_mock_servicer``).

It is a fake (no containers run): a test scripts what "the cloud" does — a sandbox's end (exit
code + result status: OOM, eviction, timeout…), scheduling that never happens (capacity), a failing
image build with logs, a sandbox that finished before the client saw its task (ConflictError),
a name already taken (AlreadyExists), dropped connections (UNAVAILABLE / a closed stream).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpclib.server
from grpclib import GRPCError, Status
from google.protobuf import empty_pb2

from modal._utils.grpc_testing import patch_mock_servicer
from modal._utils.jwt_utils import DecodedJwt
from modal_proto import api_pb2
from modal_proto.api_grpc import ModalClientBase

GS = api_pb2.GenericResult
IMAGE_BUILDER_VERSION = "2025.06"

# Names a test uses to script a sandbox's end.
RESULTS = {
    "success": GS.GENERIC_STATUS_SUCCESS, "failure": GS.GENERIC_STATUS_FAILURE,
    "terminated": GS.GENERIC_STATUS_TERMINATED, "timeout": GS.GENERIC_STATUS_TIMEOUT,
    "init_failure": GS.GENERIC_STATUS_INIT_FAILURE, "internal_failure": GS.GENERIC_STATUS_INTERNAL_FAILURE,
    "eviction": GS.GENERIC_STATUS_MEMORY_MANAGER_EVICTION, "oom": GS.GENERIC_STATUS_KERNEL_OOM_KILL,
    "thrashing": GS.GENERIC_STATUS_MEMORY_THRASHING_EVICTION,
}


@dataclass
class FakeSandbox:
    id: str
    app_id: str
    name: str
    tags: dict[str, str]
    definition: Any
    created_at: float
    scheduled: bool = True
    task_id: str = ""
    result: Any = None           # api_pb2.GenericResult once finished
    stdout: str = ""
    stderr: str = ""

    @property
    def running(self) -> bool:
        return self.result is None


@dataclass
class Script:
    """What the fake cloud does next (tests set these)."""

    schedule: bool = True
    """False: new sandboxes are never scheduled (no capacity): the client waits, then gives up."""
    finish_before_scheduled: tuple[int, str] | None = None
    """(exit code, result name): the next sandbox ends before the client sees its task."""
    build_failure: str | None = None
    """Next image build fails with these build logs."""
    build_seconds: float = 0.0
    """How long each image build takes (real seconds)."""
    fail: dict[str, list[tuple[Status, str]]] = field(default_factory=dict)
    """RPC name → errors to answer the next calls with (one popped per call)."""


@patch_mock_servicer
class FakeModalServicer(ModalClientBase):
    def __init__(self, state: "FakeModal") -> None:
        self.s = state

    async def _maybe_fail(self, name: str) -> None:
        s = self.s
        s.calls.append(name)
        queue = s.script.fail.get(name)
        if queue:
            status, msg = queue.pop(0)
            raise GRPCError(status, msg)

    # --- client / auth ---------------------------------------------------------------------
    async def ClientHello(self, stream) -> None:
        await stream.recv_message()
        await self._maybe_fail("ClientHello")
        await stream.send_message(api_pb2.ClientHelloResponse())

    async def AuthTokenGet(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(api_pb2.AuthTokenGetResponse(
            token=DecodedJwt.encode_without_signature({"exp": time.time() + 3600})))

    async def EnvironmentGetOrCreate(self, stream) -> None:
        req = await stream.recv_message()
        await stream.send_message(api_pb2.EnvironmentGetOrCreateResponse(
            environment_id="en-0001", metadata=api_pb2.EnvironmentMetadata(
                name=req.deployment_name or "main",
                settings=api_pb2.EnvironmentSettings(image_builder_version=IMAGE_BUILDER_VERSION))))

    # --- apps --------------------------------------------------------------------------------
    async def AppGetOrCreate(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("AppGetOrCreate")
        app_id = self.s.apps.setdefault(req.app_name, f"ap-{len(self.s.apps) + 1:04d}")
        await stream.send_message(api_pb2.AppGetOrCreateResponse(app_id=app_id))

    # --- secrets -----------------------------------------------------------------------------
    async def SecretGetOrCreate(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("SecretGetOrCreate")
        sid = f"st-{next(self.s._ids):04d}"
        self.s.secrets[sid] = dict(req.env_dict)
        await stream.send_message(api_pb2.SecretGetOrCreateResponse(secret_id=sid))

    # --- mounts (files inline: every project file is < 4 MiB) -------------------------------
    async def MountGetOrCreate(self, stream) -> None:
        req = await stream.recv_message()
        mid = f"mo-{next(self.s._ids):04d}"
        self.s.mounts[mid] = [f.filename for f in req.files]
        self.s.mount_files[mid] = list(req.files)  # names, hashes, modes (contents: blobs by hash)
        await stream.send_message(api_pb2.MountGetOrCreateResponse(mount_id=mid))

    async def MountPutFile(self, stream) -> None:
        req = await stream.recv_message()
        if not req.data_blob_id:  # inline content (an empty file is b"": stored all the same)
            self.s.blobs[req.sha256_hex] = req.data
        await stream.send_message(api_pb2.MountPutFileResponse(exists=req.sha256_hex in self.s.blobs))

    async def MountBatchedCheckExistence(self, stream) -> None:
        req = await stream.recv_message()
        await stream.send_message(api_pb2.MountBatchedCheckExistenceResponse(
            missing_sha256_hex_hashes=[h for h in req.sha256_hex_hashes if h not in self.s.blobs]))

    # --- images ------------------------------------------------------------------------------
    async def ImageGetOrCreate(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("ImageGetOrCreate")
        key = req.image.SerializeToString(deterministic=True)
        s = self.s
        if key in s.images:
            image_id = s.images[key]
            if s.image_results[image_id].status == GS.GENERIC_STATUS_SUCCESS:
                await stream.send_message(api_pb2.ImageGetOrCreateResponse(
                    image_id=image_id, result=s.image_results[image_id]))
                return
        image_id = f"im-{next(s._ids):04d}"
        s.images[key] = image_id
        s.image_defs[image_id] = req.image
        if s.script.build_failure is not None:
            s.build_logs[image_id] = s.script.build_failure
            s.image_results[image_id] = GS(status=GS.GENERIC_STATUS_FAILURE)
            s.script.build_failure = None
        else:
            s.record_image(image_id, req.image)
            s.image_results[image_id] = GS(status=GS.GENERIC_STATUS_SUCCESS)
        s.builds.append(image_id)
        await stream.send_message(api_pb2.ImageGetOrCreateResponse(image_id=image_id))

    async def ImageJoinStreaming(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("ImageJoinStreaming")
        s = self.s
        logs = [api_pb2.TaskLogs(data=line + "\n", file_descriptor=api_pb2.FILE_DESCRIPTOR_STDOUT)
                for line in s.build_logs.get(req.image_id, "").splitlines()]
        await stream.send_message(api_pb2.ImageJoinStreamingResponse(task_logs=logs, entry_id="1"))
        await asyncio.sleep(s.script.build_seconds)
        await stream.send_message(api_pb2.ImageJoinStreamingResponse(
            result=s.image_results[req.image_id], entry_id="2", eof=True))

    # --- sandboxes ---------------------------------------------------------------------------
    async def SandboxCreate(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("SandboxCreate")
        s = self.s
        d = req.definition
        if d.name and any(sb.name == d.name and sb.app_id == req.app_id and sb.running
                          for sb in s.sandboxes.values()):
            raise GRPCError(Status.ALREADY_EXISTS, f"Sandbox with name '{d.name}' already exists")
        sid = "sb-" + f"{next(s._ids):022d}"  # the V1 id shape (22 characters): the SDK routes by it
        sb = FakeSandbox(sid, req.app_id, d.name, {t.tag_name: t.tag_value for t in req.tags}, d, s.now(),
                         scheduled=s.script.schedule)
        if sb.scheduled:
            sb.task_id = f"ta-{sid}"
        if s.script.finish_before_scheduled is not None:
            code, how = s.script.finish_before_scheduled
            s.script.finish_before_scheduled = None
            sb.scheduled, sb.task_id = False, ""
            sb.result = GS(status=RESULTS[how], exitcode=code)
        s.sandboxes[sid] = sb
        await stream.send_message(api_pb2.SandboxCreateResponse(sandbox_id=sid))

    def _get(self, sid: str) -> FakeSandbox:
        sb = self.s.sandboxes.get(sid)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sid} not found")
        return sb

    async def SandboxGetTaskId(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("SandboxGetTaskId")
        sb = self._get(req.sandbox_id)
        if sb.task_id:
            await stream.send_message(api_pb2.SandboxGetTaskIdResponse(task_id=sb.task_id))
        elif sb.result is not None:
            await stream.send_message(api_pb2.SandboxGetTaskIdResponse(task_result=sb.result))
        else:
            await stream.send_message(api_pb2.SandboxGetTaskIdResponse())

    async def SandboxWait(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("SandboxWait")
        sb = self._get(req.sandbox_id)
        end = time.monotonic() + min(req.timeout, 5.0)
        while sb.result is None and time.monotonic() < end:
            await asyncio.sleep(0.02)
        await stream.send_message(api_pb2.SandboxWaitResponse(result=sb.result or GS()))

    async def SandboxTerminate(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("SandboxTerminate")
        sb = self._get(req.sandbox_id)
        if sb.result is None:
            sb.result = GS(status=GS.GENERIC_STATUS_TERMINATED, exitcode=137)
            self.s.terminated.append(sb.id)
            await stream.send_message(api_pb2.SandboxTerminateResponse())
        else:
            await stream.send_message(api_pb2.SandboxTerminateResponse(existing_result=sb.result))

    async def SandboxList(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("SandboxList")
        s = self.s
        s.list_requests.append(req)
        want = {t.tag_name: t.tag_value for t in req.tags}
        out = []
        for sb in sorted(s.sandboxes.values(), key=lambda b: -b.created_at):
            if req.app_id and sb.app_id != req.app_id:
                continue
            if not req.include_finished and not sb.running:
                continue
            if req.before_timestamp and sb.created_at >= req.before_timestamp:
                continue
            if any(sb.tags.get(k) != v for k, v in want.items()):
                continue
            out.append(api_pb2.SandboxInfo(
                id=sb.id, app_id=sb.app_id, name=sb.name, created_at=sb.created_at,
                tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sb.tags.items()],
                task_info=api_pb2.TaskInfo(id=sb.task_id, result=sb.result or GS())))
        await stream.send_message(api_pb2.SandboxListResponse(sandboxes=out))

    async def SandboxListV2(self, stream) -> None:  # modal 1.6 lists V1 and V2 sandboxes through V2
        await self.SandboxList(stream)

    async def SandboxGetFromNameV2(self, stream) -> None:
        await self.SandboxGetFromName(stream)

    async def SandboxTagsGet(self, stream) -> None:
        req = await stream.recv_message()
        sb = self._get(req.sandbox_id)
        await stream.send_message(api_pb2.SandboxTagsGetResponse(
            tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sb.tags.items()]))

    async def SandboxGetFromName(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("SandboxGetFromName")
        app_id = self.s.apps.get(req.app_name)
        for sb in self.s.sandboxes.values():
            if sb.name == req.sandbox_name and sb.app_id == app_id and (sb.running or req.include_terminated):
                await stream.send_message(api_pb2.SandboxGetFromNameResponse(sandbox_id=sb.id))
                return
        raise GRPCError(Status.NOT_FOUND, f"Sandbox with name '{req.sandbox_name}' not found")

    async def SandboxGetLogs(self, stream) -> None:
        req = await stream.recv_message()
        sb = self._get(req.sandbox_id)
        text = sb.stderr if req.file_descriptor == api_pb2.FILE_DESCRIPTOR_STDERR else sb.stdout
        if text:
            await stream.send_message(api_pb2.TaskLogsBatch(
                entry_id="1", items=[api_pb2.TaskLogs(data=text, file_descriptor=req.file_descriptor)]))
        await stream.send_message(api_pb2.TaskLogsBatch(entry_id="2", eof=True))


class FakeModal:
    """The fake control plane's state, served on 127.0.0.1 from a background thread.

    Use as a context manager; ``url`` goes into ``MODAL_SERVER_URL``."""

    servicer_class: type = FakeModalServicer

    def __init__(self) -> None:
        self.script = Script()
        self.apps: dict[str, str] = {}
        self.secrets: dict[str, dict[str, str]] = {}
        self.mounts: dict[str, list[str]] = {}
        self.mount_files: dict[str, list[Any]] = {}
        self.blobs: dict[str, bytes] = {}
        self.images: dict[bytes, str] = {}
        self.image_defs: dict[str, Any] = {}
        self.image_results: dict[str, Any] = {}
        self.build_logs: dict[str, str] = {}
        self.builds: list[str] = []
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.terminated: list[str] = []
        self.list_requests: list[Any] = []
        self.calls: list[str] = []
        self._ids = itertools.count(1)
        self._t = 1_700_000_000.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpclib.server.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self._protocols: list[Any] = []

    def reset(self) -> None:
        """Forget every app, image and sandbox (a fresh account), keeping the server up."""
        def f() -> None:
            self.script = Script()
            for d in (self.apps, self.secrets, self.mounts, self.mount_files, self.blobs, self.images, self.image_defs,
                      self.image_results, self.build_logs, self.sandboxes):
                d.clear()
            for lst in (self.builds, self.terminated, self.list_requests, self.calls):
                lst.clear()
        self._on_loop(f)

    def record_image(self, image_id: str, image: Any) -> None:
        """The build log of a new image: its Dockerfile commands, one a line."""
        self.build_logs[image_id] = "".join(f"{c}\n" for c in image.dockerfile_commands)

    def now(self) -> float:
        self._t += 1.0  # strictly increasing creation times (list pages by them)
        return self._t

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1") -> "FakeModal":
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._server = grpclib.server.Server([self.servicer_class(self)])
            factory = self._server._protocol_factory

            def track():  # every client connection, so a test can drop them all
                proto = factory()
                self._protocols.append(proto)
                return proto
            self._server._protocol_factory = track
            loop.run_until_complete(self._server.start(host, self.port))
            self.port = self._server._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            self._server.close()
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-modal", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def drop_connections(self) -> int:
        """Abort every client connection at the TCP level (a network drop); the server stays up,
        so the client reconnects on its next call."""
        def f() -> int:
            n = 0
            for proto in self._protocols:
                transport = getattr(getattr(proto, "connection", None), "_transport", None)
                if transport is not None and not transport.is_closing():
                    transport.abort()
                    n += 1
            self._protocols.clear()
            return n
        return self._on_loop(f)

    def __enter__(self) -> "FakeModal":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- what the cloud does on its own ----------------------------------------------------
    def _on_loop(self, fn) -> Any:
        """Run ``fn`` on the server's loop (the servicer's state is only touched there)."""
        fut: "asyncio.Future[Any]" = asyncio.run_coroutine_threadsafe(_call(fn), self._loop)
        return fut.result(10)

    def finish(self, sandbox_id: str, exitcode: int, how: str | None = None, exception: str = "") -> None:
        """The sandbox's command ends (``how``: a RESULTS name; default from the code)."""
        if how is None:
            how = "success" if exitcode == 0 else "failure"

        def f() -> None:
            sb = self.sandboxes[sandbox_id]
            sb.result = GS(status=RESULTS[how], exitcode=exitcode, exception=exception)
        self._on_loop(f)

    def schedule(self, sandbox_id: str) -> None:
        def f() -> None:
            sb = self.sandboxes[sandbox_id]
            sb.scheduled, sb.task_id = True, f"ta-{sandbox_id}"
        self._on_loop(f)

    def write_output(self, sandbox_id: str, stdout: str = "", stderr: str = "") -> None:
        def f() -> None:
            sb = self.sandboxes[sandbox_id]
            sb.stdout += stdout
            sb.stderr += stderr
        self._on_loop(f)

    def fail_next(self, rpc: str, status: Status, message: str, times: int = 1) -> None:
        def f() -> None:
            self.script.fail.setdefault(rpc, []).extend([(status, message)] * times)
        self._on_loop(f)

    def by_name(self, name: str) -> FakeSandbox:
        return next(sb for sb in self.sandboxes.values() if sb.name == name)


async def _call(fn):
    return fn()


def client_env(monkeypatch, server: FakeModal) -> None:
    """Point the real modal client at ``server`` with fake tokens, and drop any cached client."""
    import modal.client

    monkeypatch.setenv("MODAL_SERVER_URL", server.url)
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake")
    monkeypatch.delenv("MODAL_CONFIG_PATH", raising=False)
    monkeypatch.setenv("MODAL_ENVIRONMENT", "main")
    from modal.config import config

    for k, v in (("server_url", server.url), ("token_id", "ak-fake"), ("token_secret", "as-fake")):
        monkeypatch.setitem(config._settings if hasattr(config, "_settings") else {}, k, v)
    modal.client._Client.set_env_client(None)


__all__ = ["FakeModal", "FakeModalServicer", "RESULTS", "client_env", "empty_pb2"]
