"""The dtrun server's state: its database (SQLAlchemy models, engine and sessions, Alembic
migrations), the job leases that give each job one owning controller replica, and the replica loop.

May import ``orchestrator.contract``, ``orchestrator.plan``, ``orchestrator.run`` and ``providers``;
never ``orchestrator.cli`` (the CLI imports this, not the other way round).
"""
