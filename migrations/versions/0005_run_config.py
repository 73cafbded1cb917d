"""Run config and summary through the buffer: what writers set with Writer.config() and .summary().

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# A row id, as in 0001: 64-bit in PostgreSQL, INTEGER (the rowid) in SQLite.
ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "config_entries",
        sa.Column("id", ROW_ID, primary_key=True),
        sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), nullable=False),
        sa.Column("kind", sa.Text, nullable=False, server_default="config"),  # or "summary"
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("value", sa.Text, nullable=False),
        sa.Column("time", sa.Float, nullable=False),
    )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("config_id", ROW_ID, nullable=False, server_default="0"))
    with op.batch_alter_table("shard_cursors") as batch:
        batch.add_column(sa.Column("config_id", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("shard_cursors") as batch:
        batch.drop_column("config_id")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("config_id")
    op.drop_table("config_entries")
