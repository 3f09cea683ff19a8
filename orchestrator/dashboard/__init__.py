"""The dashboard: server-rendered HTML pages of the runs and of one run, and the JSON they poll.

- ``source`` — what the pages read: the ``DataSource`` interface and ``EmbeddedSource`` over this
  machine's state store (``orchestrator.run.state``) and each run's run URI.
- ``pages`` — HTML for the runs table, one run and the team's month (no template engine, no build step).
- ``app`` — the Starlette/FastAPI ``APIRouter`` over a data source, the token check, and the
  ``dtrun dashboard`` app. ``dtrun server`` mounts the same router under ``/dashboard`` with a
  per-team source (``orchestrator.server.dashboard_source``).

May import ``orchestrator.run`` and ``orchestrator.contract``; never ``orchestrator.cli``.
"""
