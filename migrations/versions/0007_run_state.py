"""Run state: when each writer closed, and the state a sync last gave the W&B run.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("writers") as batch:
        batch.add_column(sa.Column("closed_at", sa.Float, nullable=True))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("finished_exit", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("finished_exit")
    with op.batch_alter_table("writers") as batch:
        batch.drop_column("closed_at")
