"""Ingest cursors of a directory buffer's hub: how far each shard's writers were copied in.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "shard_cursors",
        sa.Column("shard", sa.Text, primary_key=True),
        sa.Column("run", sa.Text, primary_key=True),
        sa.Column("writer", sa.Text, primary_key=True),
        sa.Column("last_id", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("shard_cursors")
