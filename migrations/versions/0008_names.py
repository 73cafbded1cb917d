"""Names as the user chooses them: each writer's key prefix, each W&B key's step axis, each key's last value, each run's mode.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03

Existing writers keep their names in W&B: their prefix is their writer id,
as every key was prefixed before. A run already synced keeps the mode of
its last successful sync. ``metric_keys`` goes: glob definitions replaced
it, and ``key_claims`` holds what it held, per W&B key.
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("writers") as batch:
        batch.add_column(sa.Column("prefix", sa.Text, nullable=True))
    op.execute("UPDATE writers SET prefix = name")
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("mode", sa.Text, nullable=True))
    op.execute(
        "UPDATE runs SET mode = (SELECT s.mode FROM syncs s WHERE s.run_id = runs.id AND s.status = 'ok'"
        " ORDER BY s.id DESC LIMIT 1)"
    )
    op.create_table(
        "key_claims",
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("step_axis", sa.Text, nullable=True),
        sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), nullable=False),
    )
    op.create_table(
        "last_values",
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )
    op.drop_table("metric_keys")


def downgrade() -> None:
    op.create_table(
        "metric_keys",
        sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
    )
    op.drop_table("last_values")
    op.drop_table("key_claims")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("mode")
    with op.batch_alter_table("writers") as batch:
        batch.drop_column("prefix")
