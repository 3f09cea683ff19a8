"""API tokens, users and teams: who is asking, and may they.

A token is ``secrets.token_urlsafe(32)`` (256 random bits), shown once when it is made; the
database keeps only its SHA-256 (``api_tokens.sha256``), so a copy of the database lets no one in.
A presented token is hashed and looked up by its hash, then the hash is compared again with
``hmac.compare_digest`` (constant time). Roles: ``admin`` (may manage the team's users and tokens)
and ``member`` (sees and stops only the team's jobs). Repeated bad tokens from one client are
refused for a while (:class:`BadTokenLimiter`: HTTP 429), so a token cannot be guessed online.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.contract.errors import DtrunError
from orchestrator.server.models import ROLES, ApiToken, Team, User


class AuthError(DtrunError):
    """A missing, malformed or unknown token (HTTP 401)."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def new_token() -> str:
    return "dtr_" + secrets.token_urlsafe(32)


def create_team(s: Session, name: str, monthly_usd: float | None = None) -> Team:
    if not name or len(name) > 100:
        raise DtrunError("team: a name of 1 to 100 characters")
    if s.scalar(select(Team).where(Team.name == name)) is not None:
        raise DtrunError(f"team: {name!r} already exists")
    if monthly_usd is not None and monthly_usd < 0:
        raise DtrunError("monthly_usd: must be >= 0")
    t = Team(name=name, monthly_usd=monthly_usd)
    s.add(t)
    s.flush()
    return t


def create_user(s: Session, team: Team, name: str, role: str = "member") -> User:
    if role not in ROLES:
        raise DtrunError(f"role: {role!r} is not one of {', '.join(ROLES)}")
    if not name or len(name) > 100:
        raise DtrunError("user: a name of 1 to 100 characters")
    if s.scalar(select(User).where(User.team_id == team.id, User.name == name)) is not None:
        raise DtrunError(f"user: {name!r} already exists in team {team.name!r}")
    u = User(team_id=team.id, name=name, role=role)
    s.add(u)
    s.flush()
    return u


def issue_token(s: Session, user: User) -> str:
    """A new token for ``user``: returned once, only its hash stored."""
    token = new_token()
    s.add(ApiToken(user_id=user.id, sha256=hash_token(token)))
    s.flush()
    return token


def authenticate(s: Session, token: str | None) -> User:
    """The user owning ``token``, else :class:`AuthError` (one message for every failure)."""
    if not token or len(token) > 200:
        raise AuthError("a valid API token is required (Authorization: Bearer <token>)")
    digest = hash_token(token)
    row = s.scalar(select(ApiToken).where(ApiToken.sha256 == digest))
    if row is None or not hmac.compare_digest(row.sha256, digest):
        raise AuthError("a valid API token is required (Authorization: Bearer <token>)")
    row.last_used = time.time()
    user = s.get(User, row.user_id)
    if user is None:
        raise AuthError("a valid API token is required (Authorization: Bearer <token>)")
    return user


class BadTokenLimiter:
    """At most ``limit`` bad tokens per client in ``window`` seconds; then refused until the window
    has passed (the caller answers 429 without looking the token up)."""

    def __init__(self, limit: int = 10, window: float = 60.0, clock=time.monotonic):
        self.limit, self.window, self.clock = limit, window, clock
        self._bad: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, client: str) -> list[float]:
        now = self.clock()
        times = [t for t in self._bad.get(client, ()) if now - t < self.window]
        if times:
            self._bad[client] = times
        else:
            self._bad.pop(client, None)
        return times

    def blocked(self, client: str) -> bool:
        with self._lock:
            return len(self._recent(client)) >= self.limit

    def record_bad(self, client: str) -> None:
        with self._lock:
            self._recent(client)
            self._bad.setdefault(client, []).append(self.clock())
            if len(self._bad) > 100_000:  # bounded memory under a spray of client addresses
                self._bad.pop(next(iter(self._bad)))
