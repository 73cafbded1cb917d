"""Quarantine: records W&B refuses for good, kept with the reason and never sent; a run's refused target.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# A row id, as in 0001: 64-bit in PostgreSQL, INTEGER (the rowid) in SQLite.
ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "quarantine",
        sa.Column("record_id", ROW_ID, sa.ForeignKey("records.id"), primary_key=True),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("time", sa.Float, nullable=False),
    )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("target_refused", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("target_refused")
    op.drop_table("quarantine")
