"""The W&B run's metrics as an upload sees them: their step axes (definitions and claims) and last values.

Definitions. W&B plots each history key against the step metric its
definition names, and keeps the definitions of the latest config only (see
tests/wandb_server.py), so every upload declares the run's whole set, before
its first row:

- one glob per prefix, ``prefix/*`` against ``prefix/<axis>``, when every
  writer with that prefix logs on one axis: O(writers), whatever the number
  of keys;
- one definition per key for the rest (writers without a prefix, as in
  wandb's own shared-mode example, or sharing a prefix across axes), from the
  run's key claims (walbuf.store.claims).

Claims. A key W&B plots against one axis can be logged on that axis only:
a record whose key is claimed for another axis (by a writer on another host
of a directory buffer: on one database, log() refuses it already) is
quarantined, and the keys an upload meets first are claimed for it.

Last values. The summary W&B shows is the latest one a client sent, whole,
so every upload sends the run's whole summary: each key's last value sent
(by this upload or an earlier one, kept in ``last_values``), overlaid by the
writers' explicit summary entries.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from ..store.claims import Conflict, claim_unheld, claimed
from ..store.schema import last_values
from .plan import PlanWriter

_WANDB_OWN = frozenset({"_timestamp", "_runtime", "_step"})  # wandb fills these in each row itself


class RunMetrics:
    """One upload's view of the run's step axes and last values; see the module docstring."""

    def __init__(self, conn: sa.Connection, run_id: int, run_writers: Iterable[PlanWriter]) -> None:
        self.run_id = run_id
        self.claims = claimed(conn, run_id)
        self.new_claims: dict[str, tuple[str | None, int]] = {}  # key -> (axis, writer id)
        self.last: dict[str, Any] = {
            key: json.loads(value)
            for key, value in conn.execute(
                sa.select(last_values.c.key, last_values.c.value).where(last_values.c.run_id == run_id)
            )
        }
        self.sent: dict[str, Any] = {}  # the last value of each key this upload sent
        axes: dict[str, set[str]] = {}
        for writer in run_writers:
            if writer.prefix:
                axes.setdefault(writer.prefix, set()).add(writer.axis)
        # prefix -> the one W&B axis of every writer with that prefix
        self.globs = {prefix: next(iter(found)) for prefix, found in axes.items() if len(found) == 1}
        self._fine: dict[int, set[str]] = {}  # writer id -> its keys found consistent with the claims

    def definitions(self) -> list[tuple[str, str]]:
        """(name, step metric) of every definition the run has: the globs, then each key no glob covers."""
        defined = [(f"{prefix}/*", axis) for prefix, axis in self.globs.items()]
        for key, (axis, _) in self.claims.items():
            if axis is not None and not self._covered(key, axis):
                defined.append((key, axis))
        return defined

    def check(self, writer: PlanWriter, keys: Iterable[str]) -> tuple[str | None, list[tuple[str, str]]]:
        """Whether ``writer`` may send a record of ``keys``: (why not, or None; the definitions it newly needs).

        Claims the keys (and the writer's axis) no writer has claimed yet.
        """
        fine = self._fine.setdefault(writer.id, set())
        if fine.issuperset(keys):  # the common case: keys it sent before
            return None, []
        new = [key for key in keys if key not in fine]
        if not new:
            return None, []
        axis = writer.axis
        wanted: dict[str, str | None] = {writer.key(key): axis for key in new}
        wanted.setdefault(axis, None)
        for wkey, want in wanted.items():
            held = self.claims.get(wkey)
            if held is not None and held[0] != want:
                conflict = Conflict(wkey, held[0], held[1])
                return conflict.explain(writer.name, axis), []
        needed = []
        for wkey, want in wanted.items():
            if self.claims.get(wkey) is None:
                self.new_claims[wkey] = (want, writer.id)
                self.claims[wkey] = (want, writer.name)
                if want is not None and not self._covered(wkey, want):
                    needed.append((wkey, want))
        fine.update(new)
        return None, needed

    def save(self, conn: sa.Connection) -> None:
        """In the upload's final transaction: the claims it made and the last values it sent."""
        # A writer may have claimed one of these keys since (for its first
        # record, as the upload sent older ones of another writer): its claim
        # stands, the record it is for will be checked at the next sync.
        claim_unheld(conn, self.run_id, self.new_claims)
        sent = [key for key in self.sent if key not in _WANDB_OWN]
        for start in range(0, len(sent), 500):
            part = sent[start : start + 500]
            conn.execute(last_values.delete().where(last_values.c.run_id == self.run_id, last_values.c.key.in_(part)))
        if sent:
            conn.execute(
                last_values.insert(),
                [
                    {"run_id": self.run_id, "key": key, "value": json.dumps(self.sent[key], allow_nan=True)}
                    for key in sent
                ],
            )

    def summary(self, explicit: dict[str, Any]) -> dict[str, Any]:
        """The run's whole summary: each key's last value, overlaid by the explicit entries."""
        whole = {key: value for key, value in {**self.last, **self.sent}.items() if key not in _WANDB_OWN}
        whole.update(explicit)
        return whole

    def _covered(self, key: str, axis: str) -> bool:
        """Whether a glob definition plots ``key`` against ``axis`` already."""
        cut = key.rfind("/")
        while cut > 0:
            if self.globs.get(key[:cut]) == axis:
                return True
            cut = key.rfind("/", 0, cut)
        return False
