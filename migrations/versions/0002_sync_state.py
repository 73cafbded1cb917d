"""Sync state: each run's W&B target, each writer's cursor and metric keys, a log of syncs.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# A record id, as in 0001: 64-bit in PostgreSQL, INTEGER (the rowid) in SQLite.
RECORD_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("wandb_id", sa.Text, nullable=True))
        batch.add_column(sa.Column("project", sa.Text, nullable=True))
        batch.add_column(sa.Column("entity", sa.Text, nullable=True))
        batch.add_column(
            sa.Column("offline_step", sa.BigInteger, nullable=False, server_default="0")
        )
    with op.batch_alter_table("writers") as batch:
        batch.add_column(sa.Column("synced_id", RECORD_ID, nullable=False, server_default="0"))
    op.create_table(
        "syncs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("mode", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("last_id", RECORD_ID, nullable=False),
        sa.Column("records", sa.Integer, nullable=False),
        sa.Column("message", sa.Text, nullable=True),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
    )
    op.create_table(
        "metric_keys",
        sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
    )


def downgrade() -> None:
    op.drop_table("metric_keys")
    op.drop_table("syncs")
    with op.batch_alter_table("writers") as batch:
        batch.drop_column("synced_id")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("offline_step")
        batch.drop_column("entity")
        batch.drop_column("project")
        batch.drop_column("wandb_id")
