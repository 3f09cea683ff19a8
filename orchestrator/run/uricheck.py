"""The job's URIs, checked on this machine before anything is rented: one line naming the field
and the fix, exit 6 (``UriRefused``), never an internal error after provisioning was paid for.

:func:`check_offline` (the dry run and ``dtrun up``; no network, no storage SDK imported):

* a malformed URI (``s3:/bucket``, ``s3//bucket``): it would otherwise become a local folder
  named ``s3:`` — refused on every provider;
* a scheme dtrun cannot use: no fsspec backend installed for it (``gs://`` needs ``gcsfs``), or
  one no backend writes (a run URI on ``http://``);
* a local run URI that cannot be written (its nearest existing folder is read-only or a file);
* local training data with no token shards (no ``.bin``/``.npy`` where ``trainer.data``
  points, or only validation shards).

:func:`check_s3_credentials_offline` (the dry run, after the budget verdict): ``s3://`` URIs with
nowhere for boto3's credential chain to take keys from (the variables, the profile's files, a
container or web identity, an EC2 instance), checked without the network or boto3; the message and
exit code are ``dtrun up``'s.

:func:`check_online` (``dtrun up`` only, after the provider checks): ``s3://`` URIs without AWS
credentials (naming what to set), then a probe of the run URI (write, read, list, delete one
object) and the data URI's shards where they are remote.

``dtrun check JOB`` reports the same items as ✓/✗ lines (:func:`problems`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from orchestrator.contract.dataset import MANIFEST, ConfigError, list_shards, read_manifest
from orchestrator.contract.errors import EXIT_NOT_FOUND, DtrunError
from orchestrator.contract.runuri import BACKENDS, READ_ONLY, malformed, scheme
from orchestrator.contract.storeprobe import classify  # the restore preflight's words for the same errors

class UriRefused(DtrunError):
    """A URI of the job cannot work: exit 6 (run URI or data not reachable), nothing rented."""

    exit_code = EXIT_NOT_FOUND


@dataclass
class Problem:
    field: str
    uri: str
    message: str
    """What is wrong and the fix, naming the field."""


def _uris(spec: Any) -> list[tuple[str, str, bool]]:
    """(field, URI as written, is the run URI) for every URI the job points at."""
    t = spec.trainer
    out = [("checkpoint.uri", spec.checkpoint.uri.replace("{name}", spec.name), True)]
    if t is None:  # a command job reads its own data
        return out
    if t.data != "synthetic":
        out.append(("trainer.data", t.data, False))
    if t.val_data:
        out.append(("trainer.val_data", t.val_data, False))
    return out


def has_module(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _local_path(uri: str) -> str:
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return os.path.abspath(os.path.expanduser(path))


def _unwritable(path: str) -> str | None:
    """Why ``path`` (a folder to create or use) cannot be written, or None."""
    p = path
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if not os.path.isdir(p):
        return f"{p} is a file, not a folder"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable by this user"
    import tempfile

    try:  # permissions are not the whole story (read-only mounts, /proc, root squash): try it
        fd, tmp = tempfile.mkstemp(prefix=".dtrun-check-", dir=p)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        return f"cannot create a file in {p}: {e.strerror or e}"
    return None


def _local_shards(uri: str, field: str) -> str | None:
    """Why local data at ``uri`` has no usable shards (the listing rule the trainer's loader uses too:
    ``orchestrator.contract.dataset``), or None."""
    import fsspec

    path = _local_path(uri)
    if not any(ch in path for ch in "*?[") and not os.path.exists(path):
        return f"{path} does not exist"
    try:
        files = list_shards(fsspec.filesystem("file"), path, uri, field,
                            which="train" if field == "trainer.data" else "val_or_all")
    except ConfigError as e:
        return str(e).removeprefix(f"{field}: ")
    if not files:
        manifest = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), MANIFEST)
        return (f"no .bin or .npy token shards at {path}"
                + (" (a manifest.json is there: is `dtrun data prepare` still running?)"
                   if os.path.exists(manifest) else ""))
    return None


def offline_problems(spec: Any) -> list[Problem]:
    """Every problem found without the network (see the module docstring)."""
    out: list[Problem] = []
    for field, uri, is_run in _uris(spec):
        fix = malformed(uri)
        if fix is not None:
            out.append(Problem(field, uri, f"{field}: {uri!r} is not a well-formed URI (a scheme needs '://': "
                                           f"did you mean {fix!r}?)"))
            continue
        sch = scheme(uri)
        if sch != "file":
            if sch not in BACKENDS:
                out.append(Problem(field, uri, f"{field}: dtrun cannot use {sch}:// URIs (it reads and writes "
                                               f"file, s3, gs, az and hf URIs); use an s3:// URI or a local path"))
                continue
            if is_run and sch in READ_ONLY:
                out.append(Problem(field, uri, f"{field}: a run URI must be writable; {sch}:// is read-only "
                                               "(use an s3:// URI or a local path)"))
                continue
            pkg = BACKENDS[sch]
            if not has_module(pkg):
                out.append(Problem(field, uri, f"{field}: {sch}:// needs the {pkg} package, which is not "
                                               f"installed (pip install {pkg}), or use an s3:// URI"))
            continue
        if is_run:
            why = _unwritable(_local_path(uri))
            if why:
                out.append(Problem(field, uri, f"{field}: the run URI {_local_path(uri)} cannot be written "
                                               f"({why}); point checkpoint.uri at a writable folder"))
        else:
            why = _local_shards(uri, field)
            if why:
                out.append(Problem(field, uri, f"{field}: {why}; run `dtrun data prepare SOURCE --out "
                                               f"{uri}` first, or point {field} at token shards"))
    return out


def check_offline(spec: Any, source: str) -> None:
    """Raise :class:`UriRefused` (exit 6) for the first offline problem."""
    found = offline_problems(spec)
    if found:
        raise UriRefused(f"{source}: {found[0].message}; nothing rented")


def s3_credentials_problem(spec: Any) -> Problem | None:
    """``s3://`` URIs and no AWS credentials in the environment or boto3's chain."""
    from orchestrator.run import nodecreds

    s3 = [(f, u) for f, u, _r in _uris(spec) if scheme(u) in ("s3", "s3a")]
    if not s3:
        return None
    if os.environ.get(nodecreds.ACCESS_KEY) and os.environ.get(nodecreds.SECRET_KEY):
        return None
    creds, _region = nodecreds._from_chain()
    if creds:
        return None
    field, uri = s3[0]
    return Problem(field, uri, f"{field}: {uri} is on S3 and no AWS credentials were found; {nodecreds.HOW}")


# Where boto3's credential chain finds keys, as far as this machine can tell without the network
# (`offline_s3_credentials`): the variables, the profile's sections, a container or web identity.
_PROFILE_KEYS = ("aws_access_key_id", "credential_process", "sso_session", "sso_start_url", "role_arn",
                 "web_identity_token_file")
_CHAIN_VARS = ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
               "AWS_WEB_IDENTITY_TOKEN_FILE")


def _profile_has_credentials(environ: Any) -> bool:
    """The selected profile (``AWS_PROFILE``, ``AWS_DEFAULT_PROFILE``, else ``default``) has keys in
    the shared credentials file, or keys / a credential process / SSO / a role in the config file."""
    import configparser

    profile = environ.get("AWS_PROFILE") or environ.get("AWS_DEFAULT_PROFILE") or "default"
    files = ((environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials", (profile,)),
             (environ.get("AWS_CONFIG_FILE") or "~/.aws/config", (f"profile {profile}", profile)))
    for path, sections in files:
        cp = configparser.RawConfigParser()
        try:
            cp.read(os.path.expanduser(path))
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        for sec in sections:
            if cp.has_section(sec) and any((cp.get(sec, k, fallback="") or "").strip() for k in _PROFILE_KEYS):
                return True
    return False


def _maybe_instance_role(environ: Any) -> bool:
    """On an EC2 instance an instance role may supply keys; only `dtrun up` can ask it (network)."""
    if (environ.get("AWS_EC2_METADATA_DISABLED") or "").lower() == "true":
        return False
    for f in ("/sys/devices/virtual/dmi/id/board_vendor", "/sys/devices/virtual/dmi/id/sys_vendor",
              "/sys/hypervisor/uuid"):
        try:
            with open(f, encoding="ascii", errors="replace") as fh:
                text = fh.read(64).strip().lower()
        except OSError:
            continue
        if "amazon ec2" in text or text.startswith("ec2"):
            return True
    return False


def offline_s3_credentials(environ: Any = None) -> bool:
    """Whether boto3's credential chain has somewhere to take keys from, checked without the
    network and without boto3: ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY``; a container or
    web-identity credential variable; the selected profile in ``~/.aws/credentials`` or
    ``~/.aws/config`` (keys, ``credential_process``, SSO, ``role_arn``); an EC2 instance (its role).
    ``dtrun up`` then resolves the chain for real (``check_online``)."""
    environ = os.environ if environ is None else environ
    if environ.get("AWS_ACCESS_KEY_ID") and environ.get("AWS_SECRET_ACCESS_KEY"):
        return True
    if any(environ.get(v) for v in _CHAIN_VARS):
        return True
    return _profile_has_credentials(environ) or _maybe_instance_role(environ)


def check_s3_credentials_offline(spec: Any, provider: str | None, source: str) -> None:
    """The dry run's check of the object store's credentials (offline: :func:`offline_s3_credentials`),
    with the message and exit code ``dtrun up`` gives: for nodes rented elsewhere, exit 5 as
    ``orchestrator.run.nodecreds.node_storage`` refuses; on this machine, exit 6 as :func:`check_online`."""
    from orchestrator.contract.errors import ProviderRefused
    from orchestrator.run import nodecreds

    s3 = [(f, u) for f, u, _r in _uris(spec) if scheme(u) in ("s3", "s3a")]
    if not s3 or offline_s3_credentials():
        return
    uses = nodecreds.s3_uses(spec)
    if provider is not None and provider not in nodecreds.ON_THIS_MACHINE and uses:
        val = {"checkpoint.uri": spec.run_uri, "trainer.data": getattr(spec.trainer, "data", None),
               "trainer.val_data": getattr(spec.trainer, "val_data", None)}
        where = " and ".join(f"{u} ({val[u]})" for u in uses)
        raise ProviderRefused(f"no AWS credentials for the {provider} nodes: {where} is on S3 and a rented "
                              f"node has no other way in; {nodecreds.HOW}; nothing rented")
    field, uri = s3[0]
    raise UriRefused(f"{source}: {field}: {uri} is on S3 and no AWS credentials were found; {nodecreds.HOW}; "
                     "nothing rented")


def remote_data_problem(field: str, uri: str) -> str | None:
    from orchestrator.contract import runuri

    try:
        fs, path = runuri._fs(uri)
        files = list_shards(fs, path, uri, field, which="train" if field == "trainer.data" else "val_or_all")
    except ConfigError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any storage error: say which, in one line
        return f"{field}: cannot list {uri}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if files:
        return None
    if read_manifest(uri):
        return f"{field}: {uri} has a manifest but no .bin or .npy token shards (is `dtrun data prepare` still running?)"
    return f"{field}: no .bin or .npy token shards at {uri}; run `dtrun data prepare SOURCE --out {uri}` first"


def probe_run_uri(uri: str) -> str | None:
    """Write, read, list and delete one small object under the run URI; why it failed, or None."""
    import uuid

    from orchestrator.contract import runuri

    key = runuri.join(uri, ".dtrun-check", f"probe-{uuid.uuid4().hex[:8]}")
    made = _missing_folders(uri)  # a local run URI's folders the probe creates: removed after it
    try:
        return _probe(uri, key)
    finally:
        for folder in made:  # deepest first; one that holds anything now stays
            try:
                os.rmdir(folder)
            except OSError:
                break


def _missing_folders(uri: str) -> list[str]:
    """The folders of a local ``uri`` that do not exist yet, deepest first (none for remote ones)."""
    if scheme(uri) != "file":
        return []
    out, path = [], _local_path(uri)
    while path and not os.path.exists(path):
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return out


def _probe(uri: str, key: str) -> str | None:
    from orchestrator.contract import runuri

    step = "write"
    try:
        runuri.write_text(key, "dtrun-check")
        step = "read"
        if runuri.read_text(key) != "dtrun-check":
            return f"{uri} returned different bytes than were written"
        step = "list"
        if key.rsplit("/", 1)[-1] not in runuri.list_dir(runuri.join(uri, ".dtrun-check")):
            return f"{uri}: the object just written is not listed"
        step = "delete"
        runuri.remove(runuri.join(uri, ".dtrun-check"), recursive=True)
    except Exception as e:  # noqa: BLE001 - every storage error is reported, in one line
        return f"cannot {step} under {uri}: {classify(e, uri)[1]}"
    return None


def online_problems(spec: Any) -> list[Problem]:
    """Credentials, the run URI probe and remote data shards (network: ``dtrun up``, ``check``)."""
    cred = s3_credentials_problem(spec)
    if cred is not None:
        return [cred]
    out: list[Problem] = []
    why = probe_run_uri(spec.run_uri)
    if why:
        out.append(Problem("checkpoint.uri", spec.run_uri, f"checkpoint.uri: {why}"))
    for field, uri, is_run in _uris(spec):
        if not is_run and scheme(uri) != "file":
            why = remote_data_problem(field, uri)
            if why:
                out.append(Problem(field, uri, why))
    return out


def check_online(spec: Any, source: str) -> None:
    """Raise :class:`UriRefused` (exit 6) for the first problem that needs the network to find."""
    found = online_problems(spec)
    if found:
        raise UriRefused(f"{source}: {found[0].message}; nothing rented")
