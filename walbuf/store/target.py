"""The W&B run a walbuf run syncs into: its id, project and entity, stored with the run."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import sqlalchemy as sa

from ..errors import ConfigError, TargetConflictError
from .schema import runs

# wandb's own rules, as its SDK checks them before it sends anything
# (wandb/sdk/wandb_settings.py, validate_run_id and validate_project). The
# SDK does not check an entity; the server looks it up. An entity is a part
# of W&B's URLs, so the project's rules are applied to it too.
RUN_ID_RESERVED = ":;,#?/'"
NAME_RESERVED = "/\\#?%:"
MAX_NAME = 128


@dataclass(frozen=True)
class Target:
    """Where a run syncs to in W&B. None: not chosen (yet)."""

    wandb_id: str | None = None
    project: str | None = None
    entity: str | None = None

    def shown(self) -> str:
        """For messages: entity/project/run id, "-" for a part not chosen."""
        return "/".join(part or "-" for part in (self.entity, self.project, self.wandb_id))


def check_target(target: Target) -> Target:
    """``target`` if W&B's rules allow each part; else ConfigError naming the part and the rule."""
    run_id = target.wandb_id
    if run_id is not None:
        if not run_id.strip():
            raise ConfigError(f"W&B run id {run_id!r} is blank")
        if run_id != run_id.strip():
            raise ConfigError(f"W&B run id {run_id!r} starts or ends with whitespace, which W&B refuses")
        bad = sorted(set(RUN_ID_RESERVED) & set(run_id))
        if bad:
            raise ConfigError(
                f"W&B run id {run_id!r} contains {''.join(bad)!r}; W&B refuses any of {RUN_ID_RESERVED!r} in a run id"
            )
    for part, value in (("project", target.project), ("entity", target.entity)):
        if value is None:
            continue
        if not value.strip():
            raise ConfigError(f"W&B {part} {value!r} is blank")
        if len(value) > MAX_NAME:
            raise ConfigError(f"W&B {part} {value[:20]!r}... is longer than W&B's {MAX_NAME} characters")
        bad = sorted(set(NAME_RESERVED) & set(value))
        if bad:
            raise ConfigError(
                f"W&B {part} {value!r} contains {''.join(bad)!r}; W&B refuses any of {NAME_RESERVED!r} in the {part}"
                + (
                    " (give the entity with --entity, not as part of the project)"
                    if part == "project" and "/" in value
                    else ""
                )
            )
    return target


def read_target(conn: sa.Connection, run_id: int) -> Target:
    row = conn.execute(sa.select(runs.c.wandb_id, runs.c.project, runs.c.entity).where(runs.c.id == run_id)).one()
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
