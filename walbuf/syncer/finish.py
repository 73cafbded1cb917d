"""Run state: a W&B run is running while its job may still log, and finished once it is done.

Every upload leaves the W&B run's finish state alone (wandb's
x_update_finish_state off): a sync never finishes a run whose job may still
log, and a sync that is killed or interrupted changes nothing. W&B's server
marks a run crashed once it has heard nothing for about 5 minutes, and
between syncs nothing is connected; so each upload of a run that goes on
ends by marking it preempting (wandb's signal for a run that will send more
later: W&B shows it preempting, then preempted, never crashed), and the
next upload makes it running again. Once every writer of
the run has closed or died and everything is delivered, the next sync
finishes the run: exit code 0 when every writer closed (W&B shows
"finished"), 1 when a writer died without closing or closed failed (an
exception escaped its ``with`` block, or ``close(failed=True)``: "failed"). A writer that
opens again makes the run running again, and a later sync finishes it again.

A writer is closed when its row says so (Writer.close() notes it); open
when it holds the lock that owns its id (the kernel or the PostgreSQL
server drops it when its process dies); closed too when the note it left
beside its lock file says so (a SQLite or directory buffer: Writer.close()
writes that note first, and it needs no new disk space, so a full disk that
refused the row's note leaves this one); else it died.
"""

from __future__ import annotations

import sqlalchemy as sa

from ..buffer import Buffer
from ..store import Storage
from ..store.schema import cursors, pending, records, runs, writers

EXIT_ALL_CLOSED = 0
EXIT_A_WRITER_DIED = 1


def outcome(storage: Storage, buffer: Buffer, run: str) -> tuple[int, tuple[str, ...]] | None:
    """The exit code to finish the run with now and the writers that failed or died (1) or none (0); None: a writer
    may still log, records wait, or it is finished so already."""
    with storage.begin_read() as conn:
        row = conn.execute(sa.select(runs.c.id, runs.c.finished_exit, runs.c.wandb_id).where(runs.c.name == run)).one()
        members = conn.execute(
            sa.select(
                writers.c.id, writers.c.name, writers.c.closed_at, writers.c.close_exit, writers.c.synced_id
            ).where(writers.c.run_id == row.id)
        ).all()
        if not members:
            return None
        waiting = conn.execute(
            sa.select(records.c.id)
            .where(
                records.c.id > min(m.synced_id for m in members),
                records.c.writer_id.in_([m.id for m in members]),
                pending(cursors({m.id: m.synced_id for m in members})),
            )
            .limit(1)
        ).first()
    if waiting is not None:
        return None
    if row.wandb_id is None:
        return None  # never uploaded: there is no W&B run to finish
    if not buffer.all_in_store():
        return None  # records of this run may be in a shard the hub has not taken in (or set aside, or refused)
    died: list[str] = []  # or failed
    for member in members:
        if member.closed_at is not None:
            if member.close_exit:
                died.append(member.name)
            continue
        # Read before the lock is probed: a writer that opens again in between
        # holds the lock by then.
        noted = buffer.writer_close_note(run, member.name)
        if buffer.writer_alive(run, member.name):
            return None
        if noted is None or noted:
            died.append(member.name)
    code = EXIT_A_WRITER_DIED if died else EXIT_ALL_CLOSED
    return None if row.finished_exit == code else (code, tuple(died))
