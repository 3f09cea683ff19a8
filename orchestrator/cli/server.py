"""``dtrun server`` (the HTTP API under uvicorn, optionally with direct TLS), ``dtrun server admin``
(teams, users, tokens: a token is printed once, only its hash is kept) and ``dtrun login URL``
(the server and token saved for the CLI in ``$DTRUN_HOME/server.json``, mode 0600)."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from orchestrator.contract.errors import EXIT_OK, UsageError

app = typer.Typer()
server_app = typer.Typer(help="Run the dtrun server: the HTTP API over a SQLite or PostgreSQL database.",
                         invoke_without_command=True)
admin_app = typer.Typer(help="Create teams, users and API tokens in the server's database.")
server_app.add_typer(admin_app, name="admin")
app.add_typer(server_app, name="server")

DbOpt = Annotated[Optional[str], typer.Option("--database", help="SQLAlchemy URL (default: "
                                              "$DTRUN_SERVER_DB or sqlite:///$DTRUN_HOME/server.db).")]


def _engine(database: str | None):
    from orchestrator.server.db import make_engine
    from orchestrator.server.migrate import upgrade

    engine = make_engine(database)
    upgrade(engine)
    return engine


def cmd_serve(host: str, port: int, database: str | None, tls_cert: str | None, tls_key: str | None,
              controllers: bool = True) -> int:
    import logging

    import uvicorn

    from orchestrator.server.api import create_app

    if bool(tls_cert) != bool(tls_key):
        raise UsageError("--tls-cert and --tls-key: give both for direct TLS, or neither (TLS at a reverse proxy)")
    for opt, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if path and not os.path.isfile(path):
            raise UsageError(f"{opt}: no such file {path!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = _engine(database)
    key = _server_key(engine)
    from orchestrator.server.ctlstore import CtlStore

    store = CtlStore(engine)  # the controllers' state store: the server database's ctl_* tables
    app = create_app(engine, store=store)
    loop = None
    if controllers:
        from orchestrator.server.runner import ReplicaThread

        loop = ReplicaThread(engine, secret_key=key, store=store).start()  # submitted jobs run here, with no CLI process alive
    try:
        # access logs name the method and path only: the token travels in a header, never in the URL
        uvicorn.run(app, host=host, port=port, ssl_certfile=tls_cert, ssl_keyfile=tls_key, log_level="info",
                    server_header=False)
    finally:
        if loop is not None:
            loop.stop()
    return EXIT_OK


def _server_key(engine) -> bytes | None:
    """The key of the team secrets (``orchestrator.server.teamsecrets``); refuses to start when
    secrets are stored and no key is found. ``DTRUN_SERVER_KEY`` leaves this process's environment
    once read: nodes started on this machine inherit that environment."""
    from orchestrator.server import teamsecrets
    from orchestrator.server.db import session_scope

    key = teamsecrets.load_key()
    os.environ.pop(teamsecrets.KEY_ENV, None)
    if key is None:
        with session_scope(engine) as s:
            if teamsecrets.any_secrets(s):
                raise teamsecrets.SecretKeyError(
                    f"{teamsecrets.KEY_ENV}: the database holds team secrets and no server key was found (set "
                    f"{teamsecrets.KEY_ENV} or {teamsecrets.KEY_FILE_ENV}, default {teamsecrets.default_key_file()})")
    return key


@server_app.callback()
def server(
    ctx: typer.Context,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8320,
    database: DbOpt = None,
    tls_cert: Annotated[Optional[str], typer.Option("--tls-cert", help="PEM certificate for direct TLS.")] = None,
    tls_key: Annotated[Optional[str], typer.Option("--tls-key", help="PEM private key for direct TLS.")] = None,
    controllers: Annotated[bool, typer.Option("--controllers/--api-only", help="Run a controller replica "
                                              "(launches, watches and recovers the submitted jobs) beside the API.")] = True,
) -> None:
    """Run the dtrun server: the HTTP API over a SQLite or PostgreSQL database, and a controller replica."""
    if ctx.invoked_subcommand is None:
        raise typer.Exit(cmd_serve(host, port, database, tls_cert, tls_key, controllers))


def _find(s, team: str, user: str | None = None):
    from sqlalchemy import select

    from orchestrator.contract.errors import NotFoundError
    from orchestrator.server.models import Team, User

    t = s.scalar(select(Team).where(Team.name == team))
    if t is None:
        raise NotFoundError(f"team: no team named {team!r}")
    if user is None:
        return t, None
    u = s.scalar(select(User).where(User.team_id == t.id, User.name == user))
    if u is None:
        raise NotFoundError(f"user: no user {user!r} in team {team!r}")
    return t, u


@admin_app.command("team")
def admin_team(
    name: Annotated[str, typer.Argument(help="Team name.")],
    monthly_usd: Annotated[Optional[float], typer.Option("--monthly-usd", help="The team's budget a month.")] = None,
    database: DbOpt = None,
) -> None:
    """Create a team (with an optional monthly budget in dollars)."""
    from orchestrator.server.auth import create_team
    from orchestrator.server.db import session_scope

    with session_scope(_engine(database)) as s:
        create_team(s, name, monthly_usd)
    typer.echo(f"team {name} created")


@admin_app.command("user")
def admin_user(
    team: Annotated[str, typer.Argument(help="Team name.")],
    name: Annotated[str, typer.Argument(help="User name.")],
    role: Annotated[str, typer.Option("--role", help="admin or member.")] = "member",
    database: DbOpt = None,
) -> None:
    """Create a user in a team."""
    from orchestrator.server.auth import create_user
    from orchestrator.server.db import session_scope

    with session_scope(_engine(database)) as s:
        t, _ = _find(s, team)
        create_user(s, t, name, role)
    typer.echo(f"user {name} ({role}) created in team {team}")


@admin_app.command("token")
def admin_token(
    team: Annotated[str, typer.Argument(help="Team name.")],
    user: Annotated[str, typer.Argument(help="User name.")],
    database: DbOpt = None,
) -> None:
    """Make an API token for a user; it is printed once (only its hash is stored)."""
    from orchestrator.server.auth import issue_token
    from orchestrator.server.db import session_scope

    with session_scope(_engine(database)) as s:
        _, u = _find(s, team, user)
        token = issue_token(s, u)
    typer.echo(token)


secret_app = typer.Typer(help="A team's credentials for its nodes, stored encrypted (values from stdin or a file, "
                          "never the command line).")
admin_app.add_typer(secret_app, name="secret")
KindArg = Annotated[str, typer.Argument(help="aws (S3 keys: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) or "
                                        "node (other variables for the team's nodes).")]


@admin_app.command("key")
def admin_key(
    file: Annotated[Optional[str], typer.Option("--file", help="Where (default: $DTRUN_SERVER_KEY_FILE or "
                                                "$DTRUN_HOME/server.key).")] = None,
) -> None:
    """Make the server key that encrypts the team secrets (a file with mode 0600; never overwritten)."""
    from pathlib import Path

    from orchestrator.server import teamsecrets

    path = teamsecrets.write_key_file(Path(file) if file else teamsecrets.default_key_file())
    typer.echo(f"server key written to {path} (mode 0600); keep a copy: without it the secrets cannot be read")


@secret_app.command("set")
def secret_set(
    team: Annotated[str, typer.Argument(help="Team name.")],
    kind: KindArg,
    file: Annotated[Optional[str], typer.Option("--file", help="Read NAME=VALUE lines from this file "
                                                "(default: stdin).")] = None,
    database: DbOpt = None,
) -> None:
    """Store (replace) a team's secret: NAME=VALUE lines read from stdin or --file."""
    import sys

    from orchestrator.server import teamsecrets
    from orchestrator.server.db import session_scope

    key = teamsecrets.load_key()
    if file:
        try:
            with open(file, encoding="utf-8") as f:
                text = f.read(teamsecrets.MAX_VALUE_BYTES + 1)
        except OSError as e:
            raise UsageError(f"--file: cannot read {file!r}: {e.strerror}") from None
    else:
        if sys.stdin.isatty():
            typer.echo("NAME=VALUE lines, then Ctrl-D:", err=True)
        text = sys.stdin.read(teamsecrets.MAX_VALUE_BYTES + 1)
    with session_scope(_engine(database)) as s:
        t, _ = _find(s, team)
        names = teamsecrets.set_secret(s, t, kind, text, key)
    typer.echo(f"secret {kind} of team {team} stored encrypted: {', '.join(names)}")


@secret_app.command("list")
def secret_list(
    team: Annotated[str, typer.Argument(help="Team name.")],
    database: DbOpt = None,
) -> None:
    """A team's secrets: kinds and variable names, never a value."""
    from orchestrator.server import teamsecrets
    from orchestrator.server.db import session_scope

    key = teamsecrets.load_key()
    with session_scope(_engine(database)) as s:
        t, _ = _find(s, team)
        rows = teamsecrets.list_secrets(s, t, key)
    for r in rows:
        names = ", ".join(r["names"]) if r["names"] is not None else "(names need the server key)"
        typer.echo(f"{r['kind']}: {names}")
    if not rows:
        typer.echo(f"team {team} has no secrets")


@secret_app.command("delete")
def secret_delete(
    team: Annotated[str, typer.Argument(help="Team name.")],
    kind: KindArg,
    database: DbOpt = None,
) -> None:
    """Delete a team's secret."""
    from orchestrator.contract.errors import NotFoundError
    from orchestrator.server import teamsecrets
    from orchestrator.server.db import session_scope

    with session_scope(_engine(database)) as s:
        t, _ = _find(s, team)
        if not teamsecrets.delete_secret(s, t, kind):
            raise NotFoundError(f"kind: team {team!r} has no secret {kind!r}")
    typer.echo(f"secret {kind} of team {team} deleted")


@server_app.command("import")
def server_import(
    team: Annotated[str, typer.Option("--team", help="The team the jobs go to.")],
    home: Annotated[Optional[str], typer.Option("--home", help="The embedded dtrun home (default: $DTRUN_HOME "
                                                "or ~/.dtrun).")] = None,
    user: Annotated[Optional[str], typer.Option("--user", help="The owner of the imported jobs (default: the "
                                                "team's first admin).")] = None,
    database: DbOpt = None,
) -> None:
    """Import the ended jobs of an embedded ~/.dtrun (state, attempts, spend, events) into a team;
    jobs already on the server are skipped, so running it twice imports nothing new."""
    from pathlib import Path

    from orchestrator.run.statedb import dtrun_home
    from orchestrator.server.db import session_scope
    from orchestrator.server.importer import import_store, open_home, pick_user

    src = Path(home).expanduser() if home else dtrun_home()
    store = open_home(src)
    with session_scope(_engine(database)) as s:
        t, _ = _find(s, team)
        got = import_store(s, store, t, pick_user(s, t, user), str(src))
    store.close()
    for name, why in got["skipped"]:
        typer.echo(f"skipped {name}: {why}")
    typer.echo(f"imported {len(got['imported'])} jobs ({got['attempts']} attempts, {got['events']} events, "
               f"${got['spend_usd']:.2f} spent) from {src} into team {team}")


@app.command()
def login(
    url: Annotated[str, typer.Argument(help="The server, e.g. https://dtrun.example.com.")],
    token: Annotated[Optional[str], typer.Option("--token", help="API token (default: $DTRUN_TOKEN, else asked).")] = None,
) -> None:
    """Save a dtrun server and token for this CLI ($DTRUN_HOME/server.json, mode 0600)."""
    from orchestrator.cli import remote

    if not url.startswith(("http://", "https://")):
        raise UsageError(f"URL: {url!r} must start with https:// (or http:// for a local server)")
    token = token or os.environ.get("DTRUN_TOKEN") or typer.prompt("API token", hide_input=True)
    who = remote.call("GET", "/v1/whoami", where=(url.rstrip("/"), token))
    path = remote.save_login(url, token)
    typer.echo(f"logged in to {url} as {who['user']} ({who['role']}, team {who['team']}); saved in {path}")
