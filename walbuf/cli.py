"""The `walbuf` command: a thin skin over the library. It parses arguments and calls walbuf."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from . import __version__
from .errors import (
    BufferCorruptError,
    BufferNotFoundError,
    BufferNotWritableError,
    BufferUnavailableError,
    ConfigError,
    SchemaTooNewError,
    SyncLockedError,
    TargetConflictError,
    UploadError,
    WalbufError,
)
from .doctor import doctor as examine
from .prune import parse_age, prune as prune_buffer
from .status import status as buffer_status
from .storage import read
from .syncer import RunSync, sync as sync_buffer

# Exit codes (sysexits.h where one fits); README and --help list them.
EXIT_OK = 0
EXIT_ERROR = 1  # any other walbuf error
EXIT_USAGE = 2  # bad arguments (click's own code)
EXIT_LOCKED = 11  # another syncer holds the buffer (EAGAIN: try again later)
EXIT_DATAERR = 65  # buffer corrupt, or written by a newer walbuf
EXIT_NOINPUT = 66  # buffer does not exist
EXIT_UNAVAILABLE = 69  # the buffer's PostgreSQL server cannot be reached
EXIT_NOPERM = 77  # this process may not write the buffer
EXIT_TEMPFAIL = 75  # W&B unreachable or failed: nothing advanced, the next sync retries
EXIT_CONFIG = 78  # unusable setting, or one that conflicts with the buffer

EXIT_CODES: list[tuple[type[WalbufError], int]] = [
    (SyncLockedError, EXIT_LOCKED),
    (UploadError, EXIT_TEMPFAIL),
    (BufferNotFoundError, EXIT_NOINPUT),
    (BufferUnavailableError, EXIT_UNAVAILABLE),
    (BufferNotWritableError, EXIT_NOPERM),
    (BufferCorruptError, EXIT_DATAERR),
    (SchemaTooNewError, EXIT_DATAERR),
    (ConfigError, EXIT_CONFIG),
    (TargetConflictError, EXIT_CONFIG),
    (WalbufError, EXIT_ERROR),
]

EXIT_HELP = """\b
Exit codes:
  0   success (or nothing to do)
  1   other error (the message says what to do)
  2   bad command-line usage
  11  another walbuf sync of this buffer is running
  65  buffer is corrupt or from a newer walbuf
  66  buffer does not exist
  69  the buffer's PostgreSQL server cannot be reached; retry later
  75  W&B unreachable or failed: nothing was marked synced; retry later
  77  this process may not write the buffer (reading works)
  78  unusable setting, missing or refused W&B credentials,
      or a setting that conflicts with what the buffer holds
"""


@contextmanager
def _errors() -> Iterator[None]:
    """Turn walbuf's errors into one line on stderr and a documented exit code."""
    try:
        yield
    except WalbufError as exc:
        code = next(code for kind, code in EXIT_CODES if isinstance(exc, kind))
        click.echo(f"walbuf: error: {exc}", err=True)
        sys.exit(code)


@click.group(epilog=EXIT_HELP)
@click.version_option(__version__, prog_name="walbuf")
def main() -> None:
    """walbuf: a local write-ahead-log buffer for experiment metrics, synced to W&B."""


def _json_line(record: Any) -> str:
    return json.dumps(
        {
            "run": record.run,
            "writer": record.writer,
            "step": record.step,
            "time": record.time,
            "metrics": record.metrics,
        },
        allow_nan=True,
    )


@main.command(epilog=EXIT_HELP)
@click.argument("buffer")
@click.option("--run", help="Only records of this run.")
@click.option("--writer", help="Only records of this writer.")
@click.option("--limit", type=click.IntRange(min=0), help="At most this many records.")
def records(buffer: str, run: str | None, writer: str | None, limit: int | None) -> None:
    """Print the records in BUFFER as JSON lines, in the order they were logged.

    NaN and infinities are printed as NaN, Infinity, -Infinity (as Python's
    json module reads them).
    """
    with _errors():
        for n, record in enumerate(read(buffer, run=run, writer=writer)):
            if limit is not None and n >= limit:
                break
            click.echo(_json_line(record))


def _target_text(run: RunSync) -> str:
    t = run.target
    where = "/".join(p for p in (t.entity, t.project) if p) or "(default project)"
    return f"{where}/{t.wandb_id or '(new run id)'}"


@main.command(epilog=EXIT_HELP)
@click.argument("buffer")
@click.option("--run", "run_name", metavar="NAME", help="Sync only this walbuf run (default: every run with pending records).")
@click.option("--project", help="W&B project (stored in the buffer at the first sync).")
@click.option("--entity", help="W&B entity (stored in the buffer at the first sync).")
@click.option("--run-id", help="W&B run id (default: the one stored, else a new one, then stored).")
@click.option(
    "--mode",
    type=click.Choice(["online", "offline"]),
    default="online",
    show_default=True,
    help="online: upload to W&B. offline: write a wandb offline run directory for `wandb sync`.",
)
@click.option("--dir", "directory", type=click.Path(file_okay=False), help="Where --mode offline writes (default: BUFFER.wandb/).")
@click.option("--max-records", type=click.IntRange(min=1), help="Send at most this many records; the rest waits for the next sync.")
@click.option("--max-seconds", type=click.FloatRange(min=0, min_open=True), help="Stop sending after this many seconds.")
@click.option("--wait", type=click.FloatRange(min=0), default=0, help="Wait this many seconds for another running sync of BUFFER (default: exit 11 at once).")
@click.option("--dry-run", is_flag=True, help="Say what would be sent; send and change nothing.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors (for cron).")
def sync(
    buffer: str,
    run_name: str | None,
    project: str | None,
    entity: str | None,
    run_id: str | None,
    mode: str,
    directory: str | None,
    max_records: int | None,
    max_seconds: float | None,
    wait: float,
    dry_run: bool,
    quiet: bool,
) -> None:
    """Replay BUFFER's records not yet synced into W&B, one shared-mode run per walbuf run.

    A record is marked synced only after W&B confirmed its upload. In W&B,
    writer W's metric K is logged as W/K, on the step axis W/<step_axis>.
    """
    # A wandb-using parent passes its wandb service down in WANDB_SERVICE. A
    # syncer that joined it and was then killed would leave its run open in
    # that service, and every later sync would fail with "run ID is in use":
    # each `walbuf sync` runs its own.
    os.environ.pop("WANDB_SERVICE", None)
    bar: Any = None

    def on_run(run: RunSync) -> None:
        nonlocal bar
        if quiet:
            return
        verb = "would send" if dry_run else "sending"
        writers = ", ".join(f"{w} {n}" for w, n in run.per_writer.items())
        click.echo(f"{run.run} -> {_target_text(run)}: {verb} {run.records} records ({writers})", err=True)
        if run.possibly_duplicated:
            click.echo(
                f"  {run.possibly_duplicated} of them were in an upload that was cut off;"
                " W&B may now hold those twice",
                err=True,
            )
        if bar is not None:
            bar.__exit__(None, None, None)
        bar = None if dry_run else click.progressbar(length=run.records, file=sys.stderr, label="  uploading")
        if bar is not None:
            bar.__enter__()

    def progress(n: int) -> None:
        if bar is not None:
            bar.update(n)

    with _errors():
        try:
            result = sync_buffer(
                buffer,
                run=run_name,
                project=project,
                entity=entity,
                run_id=run_id,
                mode=mode,
                directory=directory,
                max_records=max_records,
                max_seconds=max_seconds,
                wait=wait,
                dry_run=dry_run,
                progress=progress,
                on_run=on_run,
            )
        finally:
            if bar is not None:
                bar.__exit__(None, None, None)
    for run in result.runs:  # a warning: printed even with --quiet
        for c in run.config_changes:
            click.echo(
                f"walbuf: warning: run {run.run}: config {c.key!r} was {c.old_value!r} (from {c.old_writer})"
                f" and was set again to {c.new_value!r} (by {c.new_writer}): W&B gets the later value",
                err=True,
            )
    if quiet:
        return
    if not result.runs and not result.not_in_hub:
        click.echo("nothing to sync")
    for run in result.runs:
        if dry_run:
            continue
        click.echo(f"{run.run} -> {_target_text(run)}: {run.records} records synced")
        if run.offline_dir:
            click.echo(f"  upload it later with: wandb sync {run.offline_dir}")
    if dry_run:
        click.echo(f"dry run: {result.records} records would be sent; nothing was changed")
    if result.not_in_hub:
        click.echo(f"  and {result.not_in_hub} records of shards not yet in the hub, which a sync copies in first")
    if result.unreadable_shards:
        click.echo(
            f"  {result.unreadable_shards} live shards of other hosts are not readable from here"
            " until they are sealed (see walbuf status)"
        )


@main.command(epilog=EXIT_HELP)
@click.argument("buffer")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: per run and writer, records and pending counts.")
def status(buffer: str, as_json: bool) -> None:
    """Show BUFFER's runs, writers, records, pending records and last sync."""
    with _errors():
        report = buffer_status(buffer)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(f"buffer {report.buffer}")
    for shard in report.shards:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(shard.created_at))
        waiting = "not readable from this host" if shard.not_in_hub is None else f"{shard.not_in_hub} records not yet in the hub"
        click.echo(f"shard {shard.shard} ({shard.state}, since {created}): {waiting}")
    if not report.runs:
        click.echo("  no runs yet")
    for run in report.runs:
        target = "/".join(p or "-" for p in (run.entity, run.project, run.wandb_id))
        click.echo(f"run {run.run} -> W&B {target}: {run.records} records, {run.pending} pending")
        for w in run.writers:
            last = "-" if w.last_step is None else w.last_step
            click.echo(
                f"  {w.writer:<24} {w.records:>9} records {w.pending:>9} pending"
                f"  axis {w.step_axis}, last step {last}"
            )
        if run.last_sync is None:
            click.echo("  never synced")
        else:
            s = run.last_sync
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.finished_at or s.started_at))
            detail = f": {s.message}" if s.message else ""
            click.echo(f"  last sync {when} ({s.mode}): {s.status}, {s.records} records{detail}")


@main.command(epilog=EXIT_HELP)
@click.argument("buffer")
@click.option("--older-than", required=True, metavar="AGE", help="Only records logged longer ago than this: 90s, 30m, 12h, 7d, 2w.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
def prune(buffer: str, older_than: str, quiet: bool) -> None:
    """Delete BUFFER's synced records older than AGE, then reclaim the space.

    Records not yet confirmed uploaded are never deleted.
    """
    with _errors():
        result = prune_buffer(buffer, older_than=parse_age(older_than))
    if not quiet:
        click.echo(
            f"deleted {result.deleted} synced records"
            + (f" and {result.shards_removed} ingested shards" if result.shards_removed else "")
            + f"; {result.bytes_before:,} -> {result.bytes_after:,} bytes"
        )


@main.command(epilog=EXIT_HELP)
@click.argument("buffer")
def doctor(buffer: str) -> None:
    """Check BUFFER: integrity, journal mode, schema, pending records, syncs cut off or failed.

    Exits 1 if something needs a person, and says what to do.
    """
    with _errors():
        report = examine(buffer)
    click.echo(f"buffer {report.buffer}")
    for f in report.findings:
        click.echo(f"  {'ok  ' if f.ok else 'FAIL'}  {f.check}: {f.detail}")
        if f.advice:
            click.echo(f"        -> {f.advice}")
    if not report.healthy:
        sys.exit(EXIT_ERROR)
