"""How each writer closed: normally, or with an exception escaping its ``with`` block.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04

Writers closed before this revision closed normally as far as walbuf knows
(NULL reads as 0).
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("writers") as batch:
        batch.add_column(sa.Column("close_exit", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("writers") as batch:
        batch.drop_column("close_exit")
