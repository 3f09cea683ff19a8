"""A real PostgreSQL for the server's tests: ``initdb`` + ``pg_ctl`` in a temporary folder, on a
unix socket only (no TCP), run as the unprivileged ``nobody`` when the tests run as root (the
postgres binaries refuse root), stopped (``-m immediate``) and removed after the session, also
after a failure. Without the binaries the PostgreSQL tests skip saying so (``make test``); under
``make e2e`` (``-m e2e``) a missing PostgreSQL fails them instead.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile

import pytest

_counter = itertools.count()


def _as_user(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "nobody", "--"] + cmd


def _pg_bin(name: str) -> str | None:
    """``name`` on PATH, else in Debian's /usr/lib/postgresql/<version>/bin (newest)."""
    found = shutil.which(name)
    if found:
        return found
    cands = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    return cands[-1] if cands else None


@pytest.fixture(scope="session")
def pg_cluster(request):
    """The socket folder of a running PostgreSQL cluster (superuser ``dtrun``, trust auth)."""
    missing = [b for b in ("initdb", "pg_ctl") if _pg_bin(b) is None]
    if missing or (os.geteuid() == 0 and shutil.which("runuser") is None):
        reason = f"PostgreSQL binaries not on PATH ({', '.join(missing) or 'runuser'}): install postgresql"
        if request.config.getoption("-m") and "e2e" in request.config.getoption("-m") \
                and "not e2e" not in request.config.getoption("-m"):
            pytest.fail(reason)
        pytest.skip(reason)
    base = tempfile.mkdtemp(prefix="dtrun-pg-")  # short: a unix socket path has ≤ 107 bytes
    os.chmod(base, 0o755)
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        os.chown(base, nobody.pw_uid, nobody.pw_gid)
    data = os.path.join(base, "data")
    started = False
    try:
        subprocess.run(_as_user([_pg_bin("initdb"), "-D", data, "-A", "trust", "-U", "dtrun", "-E", "UTF8"]),
                       check=True, capture_output=True, cwd=base)
        subprocess.run(_as_user([_pg_bin("pg_ctl"), "-D", data, "-l", os.path.join(base, "log"), "-w", "-o",
                                 f"-k {base} -c listen_addresses='' -c max_connections=200 -c fsync=off",
                                 "start"]), check=True, capture_output=True, cwd=base)
        started = True
        yield base
    finally:
        if started:
            subprocess.run(_as_user([_pg_bin("pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop"]),
                           capture_output=True, cwd=base)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(pg_cluster):
    """A fresh, empty database on the session's cluster, as a SQLAlchemy URL."""
    import psycopg

    name = f"t{os.getpid()}_{next(_counter)}"
    with psycopg.connect(f"host={pg_cluster} user=dtrun dbname=postgres", autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    return f"postgresql+psycopg://dtrun@/{name}?host={pg_cluster}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """Each server test once on SQLite and once on real PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'server.db'}"
    return request.getfixturevalue("pg_url")
