"""What is set up on this machine, item by item (``dtrun check``): each provider's credentials
(offline, and with ``online`` the provider's API asked whether the key is accepted), the
packages each provider needs, ``rsync``, SkyPilot's API server; for a job, its run URI (a probe
object written, read, listed and deleted), its data (shards found, vocabulary vs the model)
and this machine's torch / CUDA / NCCL.

Every item is ✓/✗ with the fix; nothing is printed that holds a key. The exit code follows the
CLI's table: 0 when everything the job needs is ✓ (without a job: at least one rentable
provider is ready), 6 when a URI of the job cannot work, 5 when no provider it names is ready,
2 for a data vocabulary the model cannot hold.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any

from orchestrator.contract.errors import EXIT_INVALID, EXIT_NOT_FOUND, EXIT_OK, EXIT_PROVIDER
from orchestrator.run.uricheck import has_module

RENTABLE = ("runpod", "lambda", "vast", "modal")
SKYPILOT_CLOUDS = ("runpod", "lambda", "vast")
PACKAGES: dict[str, tuple[tuple[str, str], ...]] = {
    # provider -> (module, what to pip install)
    "runpod": (("sky", "skypilot"), ("runpod", "'skypilot[runpod]'")),
    "lambda": (("sky", "skypilot"),),
    "vast": (("sky", "skypilot"), ("vastai_sdk", "'skypilot[vast]'")),
    "modal": (("modal", "modal"),),
}
SKY_DEFAULT_PORT = 46580
HEALTH_TIMEOUT_S = 2.5


@dataclass
class Item:
    group: str
    """credentials, packages, tools, skypilot, run URI, data, local."""
    name: str
    ok: bool | None
    """True ✓, False ✗, None: information only (not checked, or nothing to judge)."""
    detail: str
    fix: str = ""
    provider: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def credential_items(name: str, online: bool, timeout: float) -> list[Item]:
    from providers import errors as perr
    from providers import registry

    try:
        registry.get(name).check_credentials()
    except perr.AuthError as e:
        return [Item("credentials", name, False, str(e), provider=name)]
    if name in SKYPILOT_CLOUDS:
        from providers.skypilot import credentials

        where = credentials.FILES[name]
    else:
        where = ("MODAL_TOKEN_ID/MODAL_TOKEN_SECRET" if os.environ.get("MODAL_TOKEN_ID")
                 and os.environ.get("MODAL_TOKEN_SECRET") else os.environ.get("MODAL_CONFIG_PATH") or "~/.modal.toml")
    out = [Item("credentials", name, True, f"key in {where} (offline check)", provider=name)]
    if online:
        if name in SKYPILOT_CLOUDS:
            from providers.skypilot import credentials

            why = credentials.online_problem(name, timeout)
            out.append(Item("credentials", f"{name} online", why is None,
                            f"{credentials.endpoint(name)[0].split('/')[2]} accepted the key" if why is None else why,
                            provider=name))
        else:
            out.append(Item("credentials", f"{name} online", None,
                            "not asked: Modal's API is gRPC; the modal client checks the token at launch",
                            provider=name))
    return out


def package_items(name: str) -> list[Item]:
    out = []
    for module, pip in PACKAGES[name]:
        ok = has_module(module)
        out.append(Item("packages", f"{name}: {module}", ok, "installed" if ok else "not installed",
                        "" if ok else f"pip install {pip}", provider=name))
    return out


def rsync_item() -> Item:
    path = shutil.which("rsync")
    return Item("tools", "rsync", path is not None, path or "not found (SkyPilot syncs the code to the node with it)",
                "" if path else "apt-get install rsync (or brew install rsync)")


def sky_endpoint() -> str:
    """SkyPilot's API server URL as its client finds it: ``SKYPILOT_API_SERVER_ENDPOINT``, then
    ``api_server.endpoint`` in ``~/.sky/config.yaml``, then the local server's port."""
    url = os.environ.get("SKYPILOT_API_SERVER_ENDPOINT")
    if not url:
        cfg = os.path.expanduser(os.environ.get("SKYPILOT_CONFIG") or "~/.sky/config.yaml")
        try:
            import yaml

            with open(cfg) as f:
                url = ((yaml.safe_load(f) or {}).get("api_server") or {}).get("endpoint")
        except (OSError, ValueError, AttributeError):
            url = None
    if not url:
        port = os.environ.get("SKYPILOT_API_SERVER_LOCAL_PORT") or SKY_DEFAULT_PORT
        url = f"http://127.0.0.1:{port}"
    return str(url).rstrip("/")


def sky_server_item(timeout: float = HEALTH_TIMEOUT_S) -> Item:
    """running (healthy), stale (something holds the endpoint but does not answer healthy), or
    none (nothing listening: dtrun starts one at the first launch)."""
    import json
    import socket
    import urllib.error
    import urllib.request

    url = sky_endpoint()
    shown = urllib.request.urlparse(url)._replace(netloc=urllib.request.urlparse(url).hostname or "").geturl() \
        if "@" in url else url  # never print basic-auth credentials in an endpoint
    stale_fix = ("`sky api stop` (then dtrun starts a fresh one), or kill the process holding the port"
                 if "127.0.0.1" in url or "localhost" in url else "check the remote API server")
    try:
        with urllib.request.urlopen(f"{url}/api/health", timeout=timeout) as r:  # noqa: S310
            body = json.loads(r.read(65536) or b"{}")
    except urllib.error.HTTPError as e:
        if e.code == 401:
            return Item("skypilot", "API server", True, f"running at {shown} (needs `sky api login`)")
        return Item("skypilot", "API server", False, f"stale: {shown} answered HTTP {e.code}", stale_fix)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError):
            return Item("skypilot", "API server", True,
                        f"none running at {shown} (dtrun starts one at the first launch: 8-11 s, and stops it after)")
        if isinstance(reason, (TimeoutError, socket.timeout)):
            return Item("skypilot", "API server", False, f"stale: {shown} accepts connections but did not answer "
                        f"its health check within {timeout:g} s", stale_fix)
        return Item("skypilot", "API server", False, f"{shown}: {reason}", stale_fix)
    except ValueError:
        return Item("skypilot", "API server", False, f"stale: {shown} answered its health check with no JSON",
                    stale_fix)
    status = str(body.get("status", "")).lower() if isinstance(body, dict) else ""
    if status in ("healthy", "needs_auth"):
        version = body.get("version") or body.get("api_version") or ""
        return Item("skypilot", "API server", True, f"running at {shown}" + (f" (version {version})" if version else ""))
    return Item("skypilot", "API server", False, f"stale: {shown} reports {status or 'no status'}", stale_fix)


def provider_items(names: list[str], online: bool, timeout: float) -> tuple[list[Item], list[str]]:
    """Items for the rentable providers in ``names`` and the ones fully ready."""
    items: list[Item] = []
    ready = []
    sky = [n for n in names if n in SKYPILOT_CLOUDS]
    shared: list[Item] = []
    if sky:
        shared = [rsync_item(), sky_server_item()]
    for n in names:
        mine = credential_items(n, online, timeout) + package_items(n)
        items += mine
        needs = mine + (shared if n in SKYPILOT_CLOUDS else [])
        if all(i.ok is not False for i in needs):
            ready.append(n)
    order = ("credentials", "packages")
    items.sort(key=lambda i: order.index(i.group))  # stable: providers keep their order in a group
    return items + shared, ready


def local_items() -> list[Item]:
    """This machine's torch, CUDA and NCCL (what local runs and the restore preflight use)."""
    try:
        import torch
    except ImportError:
        return [Item("local", "torch", False, "not installed", "pip install torch")]
    cuda = torch.version.cuda
    gpus = torch.cuda.device_count() if cuda else 0
    out = [Item("local", "torch", True, torch.__version__),
           Item("local", "CUDA", None, f"{cuda} ({gpus} GPU{'s' if gpus != 1 else ''} visible)" if cuda
                else "none (CPU build): local runs use CPU ranks over gloo")]
    nccl = None
    if cuda:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a build without NCCL
            nccl = None
    out.append(Item("local", "NCCL", None, nccl or "not available (gloo only)"))
    return out


def _store_where(uri: str) -> str:
    from orchestrator.contract.runuri import scheme

    if scheme(uri) not in ("s3", "s3a"):
        return ""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS (default endpoint)"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not region:
        from orchestrator.run.nodecreds import _from_chain

        region = _from_chain()[1]
    return f"; endpoint {endpoint}, region {region or 'not set'}"


def job_items(spec: Any, source: str) -> tuple[list[Item], int]:
    """The job's URI and data items, and the exit code they call for (0, 2 or 6)."""
    from orchestrator.contract.errors import SpecError
    from orchestrator.run import uricheck
    from orchestrator.run.datacheck import check_data_vocab

    items: list[Item] = []
    code = EXIT_OK
    offline = uricheck.offline_problems(spec)
    bad_fields = {p.field for p in offline}
    for p in offline:
        items.append(Item("run URI" if p.field == "checkpoint.uri" else "data", p.field, False, p.message))
        code = EXIT_NOT_FOUND
    if "checkpoint.uri" not in bad_fields:
        cred = uricheck.s3_credentials_problem(spec)
        if cred is not None:
            items.append(Item("run URI" if cred.field == "checkpoint.uri" else "data", cred.field, False, cred.message))
            code = EXIT_NOT_FOUND
            bad_fields.add(cred.field)
        else:
            why = uricheck.probe_run_uri(spec.run_uri)
            items.append(Item("run URI", "checkpoint.uri", why is None,
                              f"{spec.run_uri}: wrote, read, listed and deleted a probe object{_store_where(spec.run_uri)}"
                              if why is None else f"checkpoint.uri: {why}"))
            if why is not None:
                code = EXIT_NOT_FOUND
    t = spec.trainer
    if t is None:  # a command job reads its own data: nothing of dtrun's to check
        items.append(Item("data", "command", None, "your command reads its own data (not checked)"))
        return items, code
    for field, uri in (("trainer.data", t.data), ("trainer.val_data", t.val_data)):
        if not uri or uri == "synthetic":
            if field == "trainer.data":
                items.append(Item("data", field, None, "synthetic tokens (no data to check)"))
            continue
        if field in bad_fields:
            continue
        why = None if uricheck.scheme(uri) == "file" else uricheck.remote_data_problem(field, uri)
        items.append(Item("data", field, why is None, f"{uri}: token shards found{_store_where(uri)}" if why is None
                          else why))
        if why is not None:
            code = EXIT_NOT_FOUND
    if code == EXIT_OK:
        try:
            check_data_vocab(spec, source)
        except SpecError as e:
            items.append(Item("data", "vocabulary", False, str(e)))
            return items, EXIT_INVALID
        from orchestrator.contract.dataset import read_manifest

        m = read_manifest(t.data) if t.data != "synthetic" else None
        if m and m.get("vocab_size"):
            items.append(Item("data", "vocabulary", True, f"data's tokenizer has {int(m['vocab_size']):,} tokens ≤ the "
                              f"model's vocab_size {t.model_spec.vocab_size:,}"))
    return items, code


def check(spec: Any | None = None, source: str = "", online: bool = False, timeout: float = 10.0
          ) -> tuple[list[Item], int, list[str]]:
    """(items, exit code, ready providers) for this machine, or for ``spec`` when given."""
    names = list(RENTABLE) if spec is None else [p for p in spec.resources.providers if p in RENTABLE]
    items, ready = provider_items(names, online, timeout)
    if spec is None:
        return items, (EXIT_OK if ready else EXIT_PROVIDER), ready
    local = [p for p in spec.resources.providers if p not in RENTABLE]
    code = EXIT_OK
    jitems, jcode = job_items(spec, source)
    items += jitems
    items += local_items()
    if jcode != EXIT_OK:
        code = jcode
    elif not ready and not local:
        code = EXIT_PROVIDER
    return items, code, ready + local
