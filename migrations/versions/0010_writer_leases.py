"""Writer ids owned by a lease row (PostgreSQL buffers), not by a session.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04

A PostgreSQL writer owned its id through a session-level advisory lock, so
it held a connection for as long as it was open, and a pooler in
transaction mode (PgBouncer) would have broken the ownership. From this
revision it holds a row here instead, which it renews while open (see
walbuf.store.postgresql). SQLite buffers get the table too and leave it
empty: their writers own ids through lock files.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "writer_leases",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("boot_id", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started", sa.Text, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("writer_leases")
