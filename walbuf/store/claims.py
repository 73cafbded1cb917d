"""Key claims: which step axis each W&B key of a run is plotted against.

W&B plots a history key against one step metric. Writers with a prefix put
their keys under it (``train/loss``), so they never meet; writers with the
same prefix and step axis form one curve (several evaluation processes on
``eval_step``). But two writers whose keys would be the same W&B key on
two different axes (two writers without a prefix both logging ``loss``, one
on ``train_step`` and one on ``eval_step``) cannot both be right: the first
writer to log the key claims it for its axis, and the second is refused.

A step axis's own key is claimed with axis None: no writer may log a metric
of that name on another axis.

Writers claim their keys at log(), in the database they write (a single
buffer's, or their host's shard). The syncer claims what it uploads, in the
order it uploads it (the hub of a directory buffer learns the claims there),
and quarantines a record that breaks a claim.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import sqlalchemy as sa

from .schema import key_claims, writers

Claims = dict[str, "str | None"]
"""W&B key -> the W&B key of its step axis (None: the key is a step axis)."""


def wandb_key(prefix: str, key: str) -> str:
    """The history key in W&B of a writer's ``key``: ``prefix/key``, or ``key`` for the prefix ""."""
    return f"{prefix}/{key}" if prefix else key


@dataclass(frozen=True)
class Conflict:
    """A W&B key that another writer claimed for another axis."""

    key: str  # the W&B key
    axis: str | None  # the axis it is claimed for (None: it is a step axis)
    writer: str  # the writer that claimed it

    def explain(self, writer: str, axis: str) -> str:
        """Why ``writer`` (on W&B axis ``axis``) may not log the key, and what to do."""
        held = (
            f"is the step axis of writer {self.writer!r}"
            if self.axis is None
            else f"is plotted against {self.axis!r} by writer {self.writer!r}"
        )
        own = "its step axis" if self.key == axis else f"a metric against {axis!r}"
        return (
            f"W&B key {self.key!r} {held}; writer {writer!r} would log it as {own}, and W&B plots a key"
            " against one axis only: give one of the writers a prefix (prefix=... or WALBUF_PREFIX),"
            " or another key name"
        )


def claimed(conn: sa.Connection, run_id: int, keys: Iterable[str] | None = None) -> dict[str, tuple[str | None, str]]:
    """The run's claims (of ``keys`` only, if given): W&B key -> (its axis, the name of the writer that claimed it)."""
    query = (
        sa.select(key_claims.c.key, key_claims.c.step_axis, writers.c.name)
        .select_from(key_claims.join(writers, writers.c.id == key_claims.c.writer_id))
        .where(key_claims.c.run_id == run_id)
    )
    if keys is None:
        return {key: (axis, name) for key, axis, name in conn.execute(query)}
    held: dict[str, tuple[str | None, str]] = {}
    wanted = list(keys)
    for start in range(0, len(wanted), 500):  # bounded IN lists
        rows = conn.execute(query.where(key_claims.c.key.in_(wanted[start : start + 500])))
        held.update({key: (axis, name) for key, axis, name in rows})
    return held


def claim(conn: sa.Connection, writer_pk: int, wanted: Claims) -> Conflict | None:
    """In a write transaction: claim ``wanted`` for writer ``writer_pk``; the first conflict, claiming nothing, if
    any."""
    run_id = conn.execute(sa.select(writers.c.run_id).where(writers.c.id == writer_pk)).scalar_one()
    held = claimed(conn, run_id, wanted)
    for key, axis in wanted.items():
        if key in held and held[key][0] != axis:
            return Conflict(key, held[key][0], held[key][1])
    _insert(conn, run_id, {key: (axis, writer_pk) for key, axis in wanted.items() if key not in held})
    return None


def claim_unheld(conn: sa.Connection, run_id: int, wanted: dict[str, tuple[str | None, int]]) -> None:
    """In a write transaction: store the claims (key -> (axis, writer id)) among ``wanted`` that no writer holds yet.

    A claim made meanwhile stands: what conflicts with it is checked when
    it is next sent.
    """
    held = claimed(conn, run_id, wanted)
    _insert(conn, run_id, {key: value for key, value in wanted.items() if key not in held})


def _insert(conn: sa.Connection, run_id: int, new: dict[str, tuple[str | None, int]]) -> None:
    if new:
        conn.execute(
            key_claims.insert(),
            [{"run_id": run_id, "key": key, "step_axis": axis, "writer_id": w} for key, (axis, w) in new.items()],
        )
