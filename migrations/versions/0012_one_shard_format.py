"""One shard format: gaps of a shard the hub could not take in yet, each shard's clock, and no SQLite shard cursors.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07

- ``log_gaps``: per shard, the byte ranges before its cursor that held no
  whole frame when read (or frames of a writer named only there), which
  every sync reads again (walbuf.directory.ingest).
- ``log_cursors.clock``: the file server's clock minus the clock of the
  shard's process, as the process measured it when it made the shard: the
  hub judges liveness and orders opens and closes by the file server's clock.
- ``shard_cursors`` goes: an older walbuf's SQLite shards are taken in
  before a hub is upgraded (walbuf.directory.upgrade), which is the last
  use of it. Other buffers never had rows in it.
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "log_gaps",
        sa.Column("shard", sa.Text, primary_key=True),
        sa.Column("start", sa.BigInteger, primary_key=True),
        sa.Column("until", sa.BigInteger, nullable=False),
    )
    with op.batch_alter_table("log_cursors") as batch:
        batch.add_column(sa.Column("clock", sa.Float, nullable=False, server_default="0"))
    op.drop_table("shard_cursors")


def downgrade() -> None:
    op.create_table(
        "shard_cursors",
        sa.Column("shard", sa.Text, primary_key=True),
        sa.Column("run", sa.Text, primary_key=True),
        sa.Column("writer", sa.Text, primary_key=True),
        sa.Column("last_id", sa.BigInteger, nullable=False),
        sa.Column("config_id", sa.BigInteger, nullable=False, server_default="0"),
    )
    with op.batch_alter_table("log_cursors") as batch:
        batch.drop_column("clock")
    op.drop_table("log_gaps")
