"""The W&B run a walbuf run syncs into: its id, project and entity, stored with the run."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import sqlalchemy as sa

from ..errors import TargetConflictError
from .schema import runs


@dataclass(frozen=True)
class Target:
    """Where a run syncs to in W&B. None: not chosen (yet)."""

    wandb_id: str | None = None
    project: str | None = None
    entity: str | None = None


def read_target(conn: sa.Connection, run_id: int) -> Target:
    row = conn.execute(
        sa.select(runs.c.wandb_id, runs.c.project, runs.c.entity).where(runs.c.id == run_id)
    ).one()
    return Target(*row)


def merge_target(stored: Target, given: Target, run: str) -> Target:
    """``stored`` with the parts it lacks taken from ``given``.

    A part that both hold with different values raises TargetConflictError.
    """
    merged = {}
    for part, option in (("wandb_id", "run id"), ("project", "project"), ("entity", "entity")):
        new, old = getattr(given, part), getattr(stored, part)
        if new is not None and old is not None and new != old:
            raise TargetConflictError(
                f"run {run!r} of this buffer syncs to W&B {option} {old!r}, not {new!r};"
                f" leave the {option} out to use {old!r}, or log to another walbuf run"
            )
        merged[part] = old if old is not None else new
    return Target(**merged)


def set_target(conn: sa.Connection, run_id: int, run: str, given: Target) -> Target:
    """Store the parts of ``given`` the run lacks (see merge_target); return the run's target."""
    stored = read_target(conn, run_id)
    merged = merge_target(stored, given, run)
    if merged != stored:
        conn.execute(runs.update().where(runs.c.id == run_id).values(**asdict(merged)))
    return merged
