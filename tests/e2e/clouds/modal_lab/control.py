"""The executing mode of the local Modal control plane: sandboxes run as real local processes.

Built on the scripted control plane (``tests/fakes/fake_modal_server.py``: the same gRPC
servicer the real ``modal`` 1.6.4 client talks to through ``MODAL_SERVER_URL``); this module
replaces its sandbox end with real processes. What it does, and where it takes shortcuts:

* **No container, no image build.** The host's Python environment (the interpreter running this
  server, its site-packages) stands in for the image's Python and packages. The image's layers
  are read from the definitions the client sent (``ImageGetOrCreate``): ``COPY`` materialises the
  files the client uploaded (``MountPutFile`` contents, ``context_files``) into the sandbox's
  folder, ``ENV`` and ``WORKDIR`` apply, ``RUN`` is *not* run (no network, no pip) — except that
  ``pip install -e DIR`` puts DIR on ``PYTHONPATH`` (what an editable install amounts to). The
  build log per layer reads like Modal's (``Building image im-…``, ``=> Step k: …``, ``Built
  image im-… in …``), each ``RUN`` marked as not run.
* **The container's filesystem** is a per-sandbox folder (``<root>/<sandbox id>/fs``): an absolute
  container path ``/x`` is ``fs/x`` (the workdir, the copied code). Nothing else is isolated:
  same user, same network namespace (127.0.0.1 is the host's), the host's ``/tmp`` is replaced by
  ``fs/tmp`` only through ``TMPDIR``.
* **Environment**: exactly what the client sent (the image's ``ENV``, then every secret of the
  definition in order: dtrun's ``env=`` dict and its ``Secret.from_dict`` both arrive as secrets),
  plus ``MODAL_TASK_ID``/``MODAL_SANDBOX_ID``/``MODAL_REGION``, ``PATH`` (this Python's bin first,
  ``python`` on it), ``HOME`` (``fs/root``), ``TMPDIR``. The server's own environment is not passed.
* **Processes**: the entrypoint runs in its own session and process group; every process of a
  sandbox carries its ``MODAL_TASK_ID`` and is found by it in ``/proc`` (torchrun's workers start
  sessions of their own), and the server is a child subreaper so orphans come back to it. When the
  main process exits the container ends: everything left of it is SIGKILLed. Nothing outlives the
  server: stopping it kills every sandbox (also on SIGTERM/SIGINT of ``serve``).
* **Lifecycle**: ``SandboxGetLogs`` streams stdout/stderr as produced (entry ids, resumable, EOF
  when the sandbox has ended and all output was sent); ``SandboxWait`` returns the real exit code
  with a result status; ``SandboxTerminate`` sends SIGTERM to the main process (like ``docker
  stop``), SIGKILL to everything after the grace (``terminate_grace``, default 30 s: Modal's
  documented grace for preempted functions; its sandbox grace is not documented); the timeout
  (``timeout_secs``) is counted from the process start and ends the sandbox with SIGKILL, status
  TIMEOUT, exit 124 (Modal's code for it).
* **Faults**: ``evict`` (SIGKILL, MEMORY_MANAGER_EVICTION, 137), ``oom`` (SIGKILL,
  KERNEL_OOM_KILL, 137), ``expire`` (the timeout reached now), ``refuse_capacity(n)``: the next n
  creates are never scheduled (the client's own GPU wait runs out, it terminates them and raises
  "Insufficient capacity").
* **Not emulated**: GPUs (the definition's GPU is recorded and billed, the processes see none),
  CPU and memory limits (recorded, not enforced: an OOM happens only when injected), real image
  builds (no pip, no apt, no registry pulls, no build cache invalidation beyond the definition's
  bytes), Modal's scheduling (placement, regions, queueing; a create is scheduled at once unless
  refused), idle timeouts, tunnels, volumes, exec/stdin, snapshots, V2 sandboxes, blob uploads of
  files over Modal's inline limit, real billing (``bill``: sandbox-seconds × dtrun's catalog price
  for the GPU, from process start to end).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpclib import GRPCError, Status

from modal_proto import api_pb2

from tests.fakes.fake_modal_server import GS, FakeModal, FakeModalServicer, FakeSandbox
from modal._utils.grpc_testing import patch_mock_servicer

DEFAULT_TERMINATE_GRACE = 30.0
EXIT_TIMEOUT = 124
EXIT_KILLED = 137
REGION = "local"


@dataclass
class ExecSandbox(FakeSandbox):
    """A sandbox with a real process behind it."""

    folder: Path | None = None
    proc: Any = None                      # asyncio.subprocess.Process
    started_at: float | None = None       # wall clock, process start (billing)
    ended_at: float | None = None
    chunks: list[tuple[int, str]] = field(default_factory=list)  # (fd, text) in order of arrival
    kill_reason: str | None = None        # "terminated" / "eviction" / "oom" / "timeout"
    gpu: str = ""                          # Modal's gpu type string
    gpu_count: int = 0
    changed: Any = None                    # asyncio.Condition: new output or the end
    timeout_secs: int = 0
    timer: Any = None                     # the timeout's loop handle


def container_path(fs: Path, path: str) -> Path:
    """``/root/dtrun`` → ``fs/root/dtrun`` (relative paths are taken from the container root)."""
    return fs / path.lstrip("/")


_ENV_RE = re.compile(r"^ENV\s+(.*)$", re.S)


def _parse_env(arg: str) -> dict[str, str]:
    parts = shlex.split(arg)
    if len(parts) == 2 and "=" not in parts[0]:
        return {parts[0]: parts[1]}
    return dict(p.split("=", 1) for p in parts if "=" in p)


def _editable_dirs(cmd: str) -> list[str]:
    """The directories a ``RUN`` line installs editable (``cd D && pip install -e .``)."""
    out = []
    cwd = "/"
    for part in re.split(r"&&|;", cmd):
        words = shlex.split(part)
        if not words:
            continue
        if words[0] == "cd" and len(words) > 1:
            cwd = os.path.normpath(os.path.join(cwd, words[1]))
        if "pip" in words and "install" in words:
            for i, w in enumerate(words):
                if w in ("-e", "--editable") and i + 1 < len(words):
                    out.append(os.path.normpath(os.path.join(cwd, words[i + 1])))
    return out


def _pids_of(marker: str) -> list[int]:
    """Every live process whose environment carries ``marker`` (``MODAL_TASK_ID=…``)."""
    needle = marker.encode() + b"\0"
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (env.startswith(needle) or b"\0" + needle in env):
            out.append(int(d))
    return out


def _become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


@patch_mock_servicer
class ExecutingServicer(FakeModalServicer):
    """The scripted servicer with real processes at the sandbox end."""

    s: "ExecutingModal"

    async def ImageJoinStreaming(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("ImageJoinStreaming")
        s = self.s
        t0 = time.monotonic()
        lines = s.build_logs.get(req.image_id, "").splitlines()
        for i, line in enumerate(lines):
            await stream.send_message(api_pb2.ImageJoinStreamingResponse(
                task_logs=[api_pb2.TaskLogs(data=line + "\n", file_descriptor=api_pb2.FILE_DESCRIPTOR_STDOUT)],
                entry_id=str(i + 1)))
            if s.script.build_seconds:
                await asyncio.sleep(s.script.build_seconds / max(1, len(lines)))
        res = s.image_results[req.image_id]
        if res.status == GS.GENERIC_STATUS_SUCCESS:
            await stream.send_message(api_pb2.ImageJoinStreamingResponse(task_logs=[api_pb2.TaskLogs(
                data=f"Built image {req.image_id} in {time.monotonic() - t0:.2f}s\n",
                file_descriptor=api_pb2.FILE_DESCRIPTOR_STDOUT)], entry_id=str(len(lines) + 1)))
        await stream.send_message(api_pb2.ImageJoinStreamingResponse(result=res, entry_id="eof", eof=True))

    async def SandboxCreate(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("SandboxCreate")
        s = self.s
        d = req.definition
        if d.name and any(sb.name == d.name and sb.app_id == req.app_id and sb.running
                          for sb in s.sandboxes.values()):
            raise GRPCError(Status.ALREADY_EXISTS, f"Sandbox with name '{d.name}' already exists")
        sid = "sb-" + f"{next(s._ids):022d}"
        gc = d.resources.gpu_config
        sb = ExecSandbox(sid, req.app_id, d.name, {t.tag_name: t.tag_value for t in req.tags}, d, s.now(),
                         gpu=gc.gpu_type, gpu_count=gc.count, timeout_secs=d.timeout_secs,
                         changed=asyncio.Condition())
        s.sandboxes[sid] = sb
        s.creates += 1
        if s.refuse_left > 0:
            s.refuse_left -= 1
            sb.scheduled = False  # never placed: the client's GPU wait runs out and it terminates it
            s.refused.append(sid)
        else:
            sb.task_id = f"ta-{sid[3:]}"
            await s.run_sandbox(sb)
        await stream.send_message(api_pb2.SandboxCreateResponse(sandbox_id=sid))

    async def SandboxTerminate(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("SandboxTerminate")
        sb = self._get(req.sandbox_id)
        if sb.result is not None:
            await stream.send_message(api_pb2.SandboxTerminateResponse(existing_result=sb.result))
            return
        self.s.terminated.append(sb.id)
        if sb.proc is None:  # never scheduled: nothing runs
            sb.result = GS(status=GS.GENERIC_STATUS_TERMINATED, exitcode=EXIT_KILLED)
        else:
            self.s.end(sb, "terminated")
        await stream.send_message(api_pb2.SandboxTerminateResponse())

    async def SandboxWait(self, stream) -> None:
        req = await stream.recv_message()
        await self._maybe_fail("SandboxWait")
        sb = self._get(req.sandbox_id)
        if sb.result is None and req.timeout > 0 and isinstance(sb, ExecSandbox):
            async with sb.changed:
                try:
                    await asyncio.wait_for(sb.changed.wait_for(lambda: sb.result is not None),
                                           min(req.timeout, 50.0))
                except asyncio.TimeoutError:
                    pass
        await stream.send_message(api_pb2.SandboxWaitResponse(result=sb.result or GS()))

    async def SandboxGetLogs(self, stream) -> None:
        req = await stream.recv_message()
        sb = self._get(req.sandbox_id)
        if not isinstance(sb, ExecSandbox):
            return await super().SandboxGetLogs(stream)
        fd = req.file_descriptor
        i = int(req.last_entry_id) if req.last_entry_id.isdigit() else 0
        end = time.monotonic() + (req.timeout or 55.0)
        while True:
            batch = [(j + 1, text) for j, (f, text) in enumerate(sb.chunks[i:], start=i) if f == fd]
            if batch:
                await stream.send_message(api_pb2.TaskLogsBatch(entry_id=str(batch[-1][0]), items=[
                    api_pb2.TaskLogs(data=text, file_descriptor=fd) for _, text in batch]))
            i = len(sb.chunks)
            if sb.result is not None and sb.ended_at is not None:
                await stream.send_message(api_pb2.TaskLogsBatch(entry_id=str(i), eof=True))
                return
            left = end - time.monotonic()
            if left <= 0:
                return  # the client reconnects with the last entry id
            async with sb.changed:
                try:
                    await asyncio.wait_for(sb.changed.wait_for(lambda: len(sb.chunks) > i or sb.ended_at is not None),
                                           left)
                except asyncio.TimeoutError:
                    pass


class ExecutingModal(FakeModal):
    """The control plane with executing sandboxes. ``root``: where sandbox folders go."""

    servicer_class = ExecutingServicer

    def __init__(self, root: str | os.PathLike[str], terminate_grace: float = DEFAULT_TERMINATE_GRACE) -> None:
        super().__init__()
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.terminate_grace = terminate_grace
        self.refuse_left = 0
        self.refused: list[str] = []
        self.creates = 0
        _become_subreaper()

    def reset(self) -> None:
        self.stop_all()
        super().reset()

        def f() -> None:
            self.refuse_left, self.creates = 0, 0
            self.refused.clear()
        self._on_loop(f)

    def stop(self) -> None:
        """Stop serving; every sandbox's processes are killed first (nothing outlives the server)."""
        self.stop_all()
        super().stop()

    # --- images -------------------------------------------------------------------------------
    def record_image(self, image_id: str, image: Any) -> None:
        """Build logs that read like Modal's for a layer that is not really built."""
        lines = [f"Building image {image_id}", ""]
        for k, cmd in enumerate(image.dockerfile_commands):
            lines.append(f"=> Step {k}: {cmd}")
            if cmd.startswith("RUN "):
                lines.append("(modal lab: RUN not run; the host's Python environment stands in for the image)")
        self.build_logs[image_id] = "\n".join(lines)

    def _layers(self, image_id: str) -> list[Any]:
        chain = []
        while image_id:
            img = self.image_defs.get(image_id)
            if img is None:
                raise GRPCError(Status.NOT_FOUND, f"Image {image_id} not found")
            chain.append(img)
            image_id = img.base_images[0].image_id if img.base_images else ""
        return chain[::-1]

    def _write_mount(self, mount_id: str, dest: Path) -> int:
        n = 0
        for f in self.mount_files.get(mount_id, []):
            data = self.blobs.get(f.sha256_hex)
            if data is None:
                raise GRPCError(Status.FAILED_PRECONDITION, f"mount {mount_id}: no content for {f.filename}")
            p = dest / f.filename.lstrip("/")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            if f.mode:
                os.chmod(p, f.mode & 0o7777)
            n += 1
        return n

    def materialise(self, sb: ExecSandbox) -> tuple[Path, dict[str, str], Path]:
        """The sandbox's folder from its image's layers and mounts: (fs root, image env, workdir)."""
        fs = sb.folder / "fs"
        (fs / "tmp").mkdir(parents=True, exist_ok=True)
        (fs / "root").mkdir(parents=True, exist_ok=True)
        env: dict[str, str] = {}
        workdir = "/"
        editable: list[str] = []
        for img in self._layers(sb.definition.image_id):
            ctx = {cf.filename: cf.data for cf in img.context_files}
            for cmd in img.dockerfile_commands:
                word, _, arg = cmd.partition(" ")
                if word == "COPY" and not arg.startswith("--from"):
                    *srcs, dst = shlex.split(arg)
                    for src in srcs:
                        if src == "." and img.context_mount_id:
                            self._write_mount(img.context_mount_id, container_path(fs, dst))
                        elif src in ctx:
                            p = container_path(fs, dst)
                            if dst.endswith("/"):
                                p = p / os.path.basename(src)
                            p.parent.mkdir(parents=True, exist_ok=True)
                            p.write_bytes(ctx[src])
                elif word == "ENV":
                    env.update(_parse_env(arg))
                elif word == "WORKDIR":
                    workdir = os.path.normpath(os.path.join(workdir, arg.strip()))
                elif word == "RUN":
                    editable += _editable_dirs(arg)
        for mid in sb.definition.mount_ids:  # mounts added at start (copy=False)
            self._write_mount(mid, fs)
        if editable:
            env["PYTHONPATH"] = os.pathsep.join([str(container_path(fs, d)) for d in editable]
                                                + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        wd = container_path(fs, sb.definition.workdir or workdir)
        wd.mkdir(parents=True, exist_ok=True)
        return fs, env, wd

    # --- processes ----------------------------------------------------------------------------
    async def run_sandbox(self, sb: ExecSandbox) -> None:
        sb.folder = self.root / sb.id
        fs, image_env, wd = self.materialise(sb)
        env = {"PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]),
               "HOME": str(fs / "root"), "TMPDIR": str(fs / "tmp"), "LANG": "C.UTF-8"}
        env.update(image_env)
        for sid in sb.definition.secret_ids:
            env.update(self.secrets.get(sid, {}))
        env.update({"MODAL_TASK_ID": sb.task_id, "MODAL_SANDBOX_ID": sb.id, "MODAL_REGION": REGION})
        argv = list(sb.definition.entrypoint_args)
        try:
            sb.proc = await asyncio.create_subprocess_exec(
                *argv, cwd=str(wd), env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as e:  # the command is not in the image
            sb.result = GS(status=GS.GENERIC_STATUS_INIT_FAILURE, exitcode=127, exception=str(e))
            sb.started_at = sb.ended_at = time.time()
            return
        sb.started_at = time.time()
        loop = asyncio.get_running_loop()
        readers = [loop.create_task(self._pump(sb, sb.proc.stdout, api_pb2.FILE_DESCRIPTOR_STDOUT)),
                   loop.create_task(self._pump(sb, sb.proc.stderr, api_pb2.FILE_DESCRIPTOR_STDERR))]
        loop.create_task(self._reap(sb, readers))
        if sb.timeout_secs:
            sb.timer = loop.call_later(sb.timeout_secs, lambda: self.end(sb, "timeout"))

    async def _pump(self, sb: ExecSandbox, pipe: Any, fd: int) -> None:
        while True:
            data = await pipe.read(65536)
            if not data:
                return
            async with sb.changed:
                sb.chunks.append((fd, data.decode(errors="replace")))
                sb.changed.notify_all()

    async def _reap(self, sb: ExecSandbox, readers: list[Any]) -> None:
        rc = await sb.proc.wait()
        self._kill_all(sb, signal.SIGKILL)  # the container ends with its main process
        try:
            await asyncio.wait_for(asyncio.gather(*readers), 10)
        except asyncio.TimeoutError:
            pass
        if sb.timer is not None:
            sb.timer.cancel()
        code = 128 - rc if rc < 0 else rc
        status = {"terminated": GS.GENERIC_STATUS_TERMINATED, "eviction": GS.GENERIC_STATUS_MEMORY_MANAGER_EVICTION,
                  "oom": GS.GENERIC_STATUS_KERNEL_OOM_KILL, "timeout": GS.GENERIC_STATUS_TIMEOUT}.get(sb.kill_reason or "")
        if status is None:
            status = GS.GENERIC_STATUS_SUCCESS if code == 0 else GS.GENERIC_STATUS_FAILURE
        if sb.kill_reason == "timeout":
            code = EXIT_TIMEOUT
        elif sb.kill_reason in ("eviction", "oom"):
            code = EXIT_KILLED
        exc = {"eviction": "evicted by the memory manager (modal lab fault)",
               "oom": "killed by the kernel OOM killer (modal lab fault)",
               "timeout": f"sandbox timed out after {sb.timeout_secs}s"}.get(sb.kill_reason or "", "")
        async with sb.changed:
            sb.ended_at = time.time()
            sb.result = GS(status=status, exitcode=code, exception=exc)
            sb.changed.notify_all()

    def _kill_all(self, sb: ExecSandbox, sig: int) -> None:
        if sb.proc is None:
            return
        try:
            os.killpg(sb.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in _pids_of(f"MODAL_TASK_ID={sb.task_id}"):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def end(self, sb: ExecSandbox, reason: str) -> None:
        """End a running sandbox: ``terminated`` (SIGTERM to the main process, SIGKILL after the
        grace), ``eviction``/``oom``/``timeout`` (SIGKILL to everything now). Loop thread only."""
        if sb.proc is None or sb.ended_at is not None or sb.kill_reason is not None:
            return
        sb.kill_reason = reason
        if reason == "terminated":
            try:
                sb.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            asyncio.get_running_loop().call_later(self.terminate_grace, self._kill_all, sb, signal.SIGKILL)
        else:
            self._kill_all(sb, signal.SIGKILL)

    def stop_all(self) -> None:
        """SIGKILL every sandbox's processes (any thread)."""
        for sb in list(self.sandboxes.values()):
            if isinstance(sb, ExecSandbox) and sb.proc is not None and sb.proc.returncode is None:
                self._kill_all(sb, signal.SIGKILL)

    # --- faults and reports (any thread) --------------------------------------------------------
    def _running_named(self, name: str) -> ExecSandbox:
        for sb in sorted(self.sandboxes.values(), key=lambda b: -b.created_at):
            if (sb.name == name or sb.id == name) and sb.result is None and isinstance(sb, ExecSandbox):
                return sb
        raise KeyError(f"no running sandbox named {name!r}")

    def fault(self, name: str, reason: str) -> str:
        """``evict``/``oom``/``expire``/``terminate`` the running sandbox called ``name``: its id."""
        how = {"evict": "eviction", "oom": "oom", "expire": "timeout", "terminate": "terminated"}[reason]

        def f() -> str:
            sb = self._running_named(name)
            if sb.proc is None:
                raise KeyError(f"sandbox {name!r} was never scheduled")
            self.end(sb, how)
            return sb.id
        return self._on_loop(f)

    def refuse_capacity(self, n: int) -> None:
        def f() -> None:
            self.refuse_left = n
        self._on_loop(f)

    def status(self) -> list[dict[str, Any]]:
        from providers.modal.api import RESULT_STATUS

        def f() -> list[dict[str, Any]]:
            out = []
            for sb in sorted(self.sandboxes.values(), key=lambda b: b.created_at):
                res = sb.result
                out.append({
                    "id": sb.id, "name": sb.name, "tags": sb.tags, "scheduled": sb.scheduled,
                    "state": "running" if res is None else RESULT_STATUS.get(res.status, "failure"),
                    "exitcode": None if res is None else res.exitcode,
                    "gpu": f"{getattr(sb, 'gpu', '')}:{getattr(sb, 'gpu_count', 0)}",
                    "timeout": getattr(sb, "timeout_secs", 0),
                    "started_at": getattr(sb, "started_at", None), "ended_at": getattr(sb, "ended_at", None),
                    "pid": sb.proc.pid if getattr(sb, "proc", None) is not None else None,
                    "folder": str(sb.folder) if getattr(sb, "folder", None) else None,
                    "argv": list(sb.definition.entrypoint_args),
                })
            return out
        return self._on_loop(f)

    def bill(self, now: float | None = None) -> dict[str, Any]:
        """Sandbox-seconds × dtrun's catalog price for the sandbox's GPU (per GPU-hour × count)."""
        now = time.time() if now is None else now
        rows = []
        for st in self.status():
            if st["started_at"] is None:
                continue
            gpu, _, count = st["gpu"].partition(":")
            price = catalog_price(gpu, int(count or 0))
            seconds = (st["ended_at"] or now) - st["started_at"]
            rows.append({"id": st["id"], "name": st["name"], "gpu": st["gpu"], "seconds": round(seconds, 3),
                         "usd_per_hour": price, "usd": round(seconds / 3600 * price, 6)})
        return {"sandboxes": rows, "usd": round(sum(r["usd"] for r in rows), 6),
                "seconds": round(sum(r["seconds"] for r in rows), 3)}


def catalog_price(modal_gpu: str, count: int) -> float:
    """USD per hour for ``count`` of Modal's ``modal_gpu`` in dtrun's catalog (0 if none)."""
    from providers.catalog import price_rows
    from providers.modal import MODAL_GPUS

    name = {v: k for k, v in MODAL_GPUS.items()}.get(modal_gpu, modal_gpu)
    for r in price_rows("modal"):
        if r.gpu == name and r.gpus_per_node == count:
            return r.price * count
    return 0.0
