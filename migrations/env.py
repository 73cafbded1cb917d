"""Alembic environment: walbuf always hands Alembic an open connection in a write transaction."""

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "walbuf's migrations run when a buffer is opened (walbuf.init, walbuf.read);"
        " they are not meant for the alembic command line"
    )
context.configure(connection=connection, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
