"""Remember each writer's last step when prune deletes its records.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("writers") as batch:
        batch.add_column(sa.Column("pruned_step", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("writers") as batch:
        batch.drop_column("pruned_step")
