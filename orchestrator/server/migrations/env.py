"""Alembic's environment for the server's migrations: run online against the connection
:func:`orchestrator.server.migrate.upgrade` hands in (``config.attributes["connection"]``)."""

from alembic import context

from orchestrator.server.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
