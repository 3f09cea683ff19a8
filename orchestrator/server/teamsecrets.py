"""A team's credentials on the server, encrypted at rest, handed only to that team's nodes.

Storage: each ``team_secrets`` row holds one *kind* of a team's credentials — ``aws`` (the object
store: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, optional ``AWS_SESSION_TOKEN`` and the
plain ``AWS_ENDPOINT_URL``/``AWS_DEFAULT_REGION``…) or ``node`` (any other variables the team's
nodes need, e.g. ``HF_TOKEN``, ``WANDB_API_KEY``) — as ``NAME=VALUE`` lines encrypted with
AES-256-GCM (``cryptography``'s AEAD, pyca: well kept, constant-time tag check). The row's
``ciphertext`` is ``b"v1" + 12-byte random nonce + ciphertext + 16-byte tag``; the associated data
is ``team id + kind``, so a ciphertext copied into another team's row (or another kind) does not
decrypt: a database write alone cannot move one team's keys to another team's nodes.

The key: 32 random bytes, urlsafe-base64, from ``DTRUN_SERVER_KEY`` or a key file
(``DTRUN_SERVER_KEY_FILE``, default ``$DTRUN_HOME/server.key``) readable by its owner only (mode
0600: a looser file is refused). ``dtrun server admin key`` makes one. The database alone (a
backup, a replica's disk) holds nothing usable; whoever holds the key and the database holds the
teams' credentials. ``dtrun server`` refuses to start when secrets exist and no key is found, and
removes ``DTRUN_SERVER_KEY`` from its own environment once read, so no node it starts on this
machine inherits it.

Handing out (:func:`team_node_storage`): at each launch the replica decrypts the job's team's rows
(never another team's) into ``LaunchRequest.secrets`` — never logged, never stored (see
``providers.base.LaunchRequest``). ``aws`` goes only to a job whose ``checkpoint.uri`` or data is
``s3://``; the server's own environment and AWS credential chain are never handed to a node.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path
from typing import Any, Mapping

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.contract.errors import DtrunError, ProviderRefused, UsageError
from orchestrator.run.nodecreds import ACCESS_KEY, AWS_PLAIN_VARS, AWS_SECRET_VARS, SECRET_KEY, s3_uses
from orchestrator.server.models import Team, TeamSecret

KEY_ENV = "DTRUN_SERVER_KEY"
KEY_FILE_ENV = "DTRUN_SERVER_KEY_FILE"
KINDS = ("aws", "node")
_VERSION = b"v1"
_NONCE = 12
MAX_VALUE_BYTES = 64 * 1024


class SecretKeyError(UsageError):
    """No usable server key (missing, malformed, a key file others can read, the wrong key)."""


def default_key_file() -> Path:
    from orchestrator.run.statedb import dtrun_home

    return Path(os.environ.get(KEY_FILE_ENV) or dtrun_home() / "server.key")


def _decode_key(text: str, where: str) -> bytes:
    try:
        key = base64.urlsafe_b64decode(text.strip().encode("ascii"))
    except (binascii.Error, ValueError, UnicodeEncodeError):
        key = b""
    if len(key) != 32:
        raise SecretKeyError(f"{where}: not a dtrun server key (32 bytes, urlsafe base64; "
                             "make one with `dtrun server admin key`)")
    return key


def load_key(environ: Mapping[str, str] | None = None, path: Path | None = None) -> bytes | None:
    """The server key from ``DTRUN_SERVER_KEY`` or the key file; None when neither exists."""
    environ = os.environ if environ is None else environ
    if environ.get(KEY_ENV):
        return _decode_key(environ[KEY_ENV], KEY_ENV)
    path = Path(path) if path is not None else default_key_file()
    if not path.exists():
        return None
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretKeyError(f"{KEY_FILE_ENV} ({path}): mode {stat.S_IMODE(mode):04o} lets others read the key; "
                             f"chmod 600 {path}")
    return _decode_key(path.read_text(), str(path))


def write_key_file(path: Path) -> Path:
    """A new random key in ``path`` (mode 0600); refuses to overwrite one."""
    path = Path(path)
    if path.exists():
        raise UsageError(f"--file: {path} exists; a new key would make the stored secrets unreadable")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(base64.urlsafe_b64encode(os.urandom(32)).decode("ascii") + "\n")
    return path


def _aad(team_id: int, kind: str) -> bytes:
    return f"dtrun-team-secret:{team_id}:{kind}".encode()


def encrypt(key: bytes, team_id: int, kind: str, plaintext: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = os.urandom(_NONCE)
    return _VERSION + nonce + AESGCM(key).encrypt(nonce, plaintext, _aad(team_id, kind))


def decrypt(key: bytes, team_id: int, kind: str, blob: bytes) -> bytes:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    blob = bytes(blob)
    if not blob.startswith(_VERSION) or len(blob) < len(_VERSION) + _NONCE + 16:
        raise SecretKeyError(f"team secret {kind!r}: not a dtrun ciphertext")
    nonce, body = blob[len(_VERSION):len(_VERSION) + _NONCE], blob[len(_VERSION) + _NONCE:]
    try:
        return AESGCM(key).decrypt(nonce, body, _aad(team_id, kind))
    except InvalidTag:
        raise SecretKeyError(f"team secret {kind!r}: the server key does not open it (another key, or the row "
                             "was altered or copied from another team)") from None


def parse_env_text(text: str, kind: str) -> dict[str, str]:
    """``NAME=VALUE`` lines (blank lines and ``#`` comments skipped) → a mapping. Errors name the
    line number, never its value."""
    out: dict[str, str] = {}
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if line.startswith("export "):
            name = name[len("export "):].strip()
        if not sep or not name or not (name.replace("_", "").isalnum() and not name[0].isdigit()):
            raise DtrunError(f"secret {kind!r}: line {i} is not NAME=VALUE (a variable name, '=', the value)")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[name] = value
    if not out:
        raise DtrunError(f"secret {kind!r}: no NAME=VALUE line given")
    if kind == "aws":
        allowed = set(AWS_SECRET_VARS) | set(AWS_PLAIN_VARS)
        bad = sorted(set(out) - allowed)
        if bad:
            raise DtrunError(f"secret 'aws': {', '.join(bad)} not one of {', '.join(sorted(allowed))} "
                             "(other variables go in kind 'node')")
        if not (out.get(ACCESS_KEY) and out.get(SECRET_KEY)):
            raise DtrunError(f"secret 'aws': needs {ACCESS_KEY} and {SECRET_KEY}")
    return out


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise DtrunError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")


def set_secret(s: Session, team: Team, kind: str, text: str, key: bytes | None) -> list[str]:
    """Store (replace) the team's ``kind``; returns the variable names (never the values)."""
    _check_kind(kind)
    if key is None:
        raise SecretKeyError(f"no server key: set {KEY_ENV} or make a key file with `dtrun server admin key` "
                             f"({default_key_file()}); secrets are stored only encrypted")
    if len(text.encode()) > MAX_VALUE_BYTES:
        raise DtrunError(f"secret {kind!r}: more than {MAX_VALUE_BYTES} bytes")
    values = parse_env_text(text, kind)
    plain = "".join(f"{k}={v}\n" for k, v in values.items()).encode()
    blob = encrypt(key, team.id, kind, plain)
    row = s.scalar(select(TeamSecret).where(TeamSecret.team_id == team.id, TeamSecret.kind == kind))
    if row is None:
        s.add(TeamSecret(team_id=team.id, kind=kind, ciphertext=blob))
    else:
        row.ciphertext = blob
    s.flush()
    return sorted(values)


def list_secrets(s: Session, team: Team, key: bytes | None) -> list[dict[str, Any]]:
    """The team's kinds and, with the key, their variable names — never a value."""
    out = []
    for row in s.scalars(select(TeamSecret).where(TeamSecret.team_id == team.id).order_by(TeamSecret.kind)):
        names = sorted(_values(key, row)) if key is not None else None
        out.append({"kind": row.kind, "names": names})
    return out


def delete_secret(s: Session, team: Team, kind: str) -> bool:
    _check_kind(kind)
    row = s.scalar(select(TeamSecret).where(TeamSecret.team_id == team.id, TeamSecret.kind == kind))
    if row is None:
        return False
    s.delete(row)
    s.flush()
    return True


def any_secrets(s: Session) -> bool:
    return s.scalar(select(TeamSecret.id).limit(1)) is not None


def _values(key: bytes, row: TeamSecret) -> dict[str, str]:
    text = decrypt(key, row.team_id, row.kind, row.ciphertext).decode()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def team_secrets(s: Session, team_id: int, key: bytes | None) -> dict[str, dict[str, str]]:
    """{kind: {name: value}} of one team (decrypted; keep it in memory only)."""
    rows = list(s.scalars(select(TeamSecret).where(TeamSecret.team_id == team_id)))
    if rows and key is None:
        raise SecretKeyError(f"team {team_id} has secrets but the server has no key ({KEY_ENV})")
    return {row.kind: _values(key, row) for row in rows}  # type: ignore[arg-type]


def team_node_storage(secrets: dict[str, dict[str, str]], team: str, spec: Any, provider: str
                      ) -> tuple[dict[str, str], dict[str, str]]:
    """``(env, secrets)`` for one launch of ``team``'s job: the team's ``node`` variables, and its
    ``aws`` keys when the spec uses S3 (ProviderRefused, exit 5, naming the command, when it does
    and the team has none). The server's own environment is never used."""
    env: dict[str, str] = {}
    out = dict(secrets.get("node") or {})
    uses = s3_uses(spec)
    if uses:
        aws = secrets.get("aws") or {}
        if not (aws.get(ACCESS_KEY) and aws.get(SECRET_KEY)):
            raise ProviderRefused(f"no S3 credentials for team {team!r}: {' and '.join(uses)} is on S3; an admin "
                                  f"sets them with `dtrun server admin secret set {team} aws` (NAME=VALUE lines "
                                  "on stdin); nothing rented")
        env.update({k: v for k, v in aws.items() if k in AWS_PLAIN_VARS})
        out.update({k: v for k, v in aws.items() if k in AWS_SECRET_VARS})
    return env, out
