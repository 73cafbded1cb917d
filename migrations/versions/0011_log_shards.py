"""How far a directory buffer's hub has taken in each log shard, and which writers each shard names.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05

Directory buffers' shards became files of frames that one process appends
(walbuf.directory.frames), readable from any host while they grow. The hub
keeps, per shard, the byte offset up to which it has taken the frames in
(in the same transaction as what they held), whether the shard's last frame
was taken in, which process appends it and when it was last heard of, and
why the last sync stopped reading it short of its end, if it did;
and per writer a shard names, the hub's writer it is and whether it is open
there. Other buffers get the tables too and leave them empty.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "log_cursors",
        sa.Column("shard", sa.Text, primary_key=True),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("ended", sa.Boolean, nullable=False),
        sa.Column("process", sa.Text),
        sa.Column("seen", sa.Float, nullable=False),
        sa.Column("refused", sa.Text),
    )
    op.create_table(
        "log_writers",
        sa.Column("shard", sa.Text, primary_key=True),
        sa.Column("local_id", sa.Integer, primary_key=True),
        sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), nullable=False),
        sa.Column("open", sa.Boolean, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("log_writers")
    op.drop_table("log_cursors")
