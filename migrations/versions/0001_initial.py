"""Initial schema: runs, writers, records.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.Text, nullable=False, unique=True),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "writers",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("step_axis", sa.Text, nullable=False),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("opened_at", sa.Float, nullable=False),
        sa.UniqueConstraint("run_id", "name", name="uq_writers_run_name"),
    )
    op.create_table(
        "records",
        # 64-bit ids in PostgreSQL; in SQLite INTEGER, the rowid (64-bit already).
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("metrics", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("records")
    op.drop_table("writers")
    op.drop_table("runs")
