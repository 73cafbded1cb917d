"""The `walbuf` and `walbuf-cron` commands: a thin skin over the library.

Each command parses its arguments, calls one library function, and formats
the result. Errors become one line on stderr and an exit code from
:mod:`walbuf.exitcodes`, never a traceback.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
import sqlalchemy as sa

from . import __version__, exitcodes
from .buffer import check_names, read
from .errors import ConfigError, WalbufError
from .ops import doctor as examine
from .ops import parse_age
from .ops import prune as prune_buffer
from .ops import status as buffer_status
from .record import Record
from .store import Target
from .syncer import RunSync, SyncResult
from .syncer import sync as sync_buffer
from .syncer.budget import end_process_after, process_age
from .syncer.follow import DEFAULT_INTERVAL
from .syncer.follow import follow as follow_buffer
from .syncer.wandb import stop_uploads

EXIT_HELP = exitcodes.help_text()
NOT_SYNCING_HELP = exitcodes.help_text(exitcodes.NOT_SYNCING)
CRON_MAX_SECONDS = 540.0  # ends each sync before the next one of a 10-minute crontab starts
# After --max-seconds, how long the process may take to end before it is ended.
PROCESS_GRACE = 0.5
# The least a sync is given when its process took its whole bound to start.
MIN_SECONDS_LEFT = 0.1
QUARANTINE_SHOWN = 5  # quarantined records named one by one; the rest are counted


def _records(n: int) -> str:
    """'1 record', '2 records'."""
    return f"{n} record" if n == 1 else f"{n} records"


def _say_what_walbuf_waits_for() -> None:
    """Print walbuf's own notes (it waits for a lock, say) on stderr, as "walbuf: ..." lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("walbuf: %(message)s"))
    logger = logging.getLogger("walbuf")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that a sync stops as cleanly."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated("SIGTERM")


class _SQLAlchemyLines(logging.Handler):
    """SQLAlchemy's warnings and errors on stderr, a line each, as walbuf's; an interruption not at all.

    SQLAlchemy logs an exception it meets while closing a connection, with
    its traceback, then raises it again unless it is an Exception
    (sqlalchemy/pool/base.py, ``_close_connection``): a Ctrl-C or SIGTERM
    arriving just then is told by walbuf's own line (_errors), not by a
    traceback before it. With no handler, Python's last resort printed it.
    """

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, KeyboardInterrupt):
            return
        text = record.getMessage() if exc is None else f"{record.getMessage()}: {type(exc).__name__}: {exc}"
        click.echo(f"walbuf: {record.name}: {text}", err=True)


def _stop_cleanly_on_signals() -> None:
    """SIGTERM stops the command as Ctrl-C does (_Terminated), each told once, in one line."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    sqlalchemy_log = logging.getLogger("sqlalchemy")
    if not any(isinstance(handler, _SQLAlchemyLines) for handler in sqlalchemy_log.handlers):
        sqlalchemy_log.addHandler(_SQLAlchemyLines())


def _one_line(exc: WalbufError) -> str:
    """An error's message on one line: what it quotes (a server's answer, say) may span several."""
    return re.sub(r"\s*\n\s*", " ", str(exc).strip())


@contextmanager
def _errors() -> Iterator[None]:
    """Turn walbuf's errors into one line on stderr and a documented exit code; Ctrl-C and SIGTERM too."""
    try:
        yield
    except WalbufError as exc:
        click.echo(f"walbuf: error: {_one_line(exc)}", err=True)
        sys.exit(exitcodes.for_error(exc).code)
    except KeyboardInterrupt as exc:
        code = exitcodes.SIGTERM if isinstance(exc, _Terminated) else exitcodes.SIGINT
        name = "SIGTERM" if code is exitcodes.SIGTERM else "Ctrl-C (SIGINT)"
        click.echo(
            f"walbuf: error: stopped by {name}; if it was uploading, that upload is marked interrupted, nothing"
            " it sent is marked synced, and the next sync sends it again (W&B may then hold some records twice)",
            err=True,
        )
        sys.exit(code.code)


@click.group(epilog=EXIT_HELP)
@click.version_option(__version__, prog_name="walbuf")
def main() -> None:
    """walbuf: a local write-ahead-log buffer for experiment metrics, synced to W&B."""
    _stop_cleanly_on_signals()


def _json_line(record: Record) -> str:
    line: dict[str, Any] = {
        "run": record.run,
        "writer": record.writer,
        "step": record.step,
        "time": record.time,
        "metrics": record.metrics,
    }
    if record.quarantined is not None:
        line["quarantined"] = record.quarantined
    # A histogram as stored and as W&B keeps it: {"_type": "histogram", ...}; an image as stored.
    return json.dumps(line, allow_nan=True, default=lambda value: value.to_json())


def _follow(options: dict[str, Any], interval: float, *, quiet: bool, verbose: bool, dry_run: bool) -> None:
    """`walbuf sync --follow`: walbuf.follow with the command's options, a line per pass that sent something."""
    alone = {
        "--dry-run": dry_run,
        "--max-records": options["max_records"],
        "--max-seconds": options["max_seconds"],
        "--wait": options["wait"],
        "--dir": options["directory"],
        "--mode offline": options["mode"] == "offline",
    }
    given = [name for name, value in alone.items() if value]
    if given:
        raise click.UsageError(f"--follow streams online until the job ends: it takes no {', '.join(given)}")

    def on_pass(result: SyncResult) -> None:
        for message in result.refused:
            click.echo(f"walbuf: warning: {message}", err=True)
        for run in result.runs:
            _say_warnings(run, options["buffer"])
            if not quiet and (run.records or run.finished is not None):
                _say_done(run, time.strftime("%H:%M:%S "))

    def on_retry(exc: WalbufError) -> None:
        click.echo(f"walbuf: warning: {exc}; the follow tries again in {interval:g}s", err=True)

    with _errors(), _process_of_its_own(verbose):
        done = follow_buffer(
            options["buffer"],
            run=options["run_name"],
            project=options["project"],
            entity=options["entity"],
            run_id=options["run_id"],
            interval=interval,
            on_pass=on_pass,
            on_retry=on_retry,
        )
    if not quiet:
        click.echo(f"followed to the end: {_records(done.records)} synced in {done.passes} passes")
    if done.needs_a_person:
        # As a sync that quarantined: a supervisor or cron line learns it from the code.
        left = f"{_records(done.quarantined)} quarantined" if done.quarantined else "part of the buffer set aside"
        click.echo(f"walbuf: the follow left {left}, never to be sent (see the warnings above)", err=True)
        sys.exit(exitcodes.QUARANTINED.code)


def _buffer_given(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """BUFFER as given; a warning where it is a URL that holds a password, which every account sees in `ps`."""
    if "://" in value:
        try:
            password = sa.make_url(value).password
        except sa.exc.ArgumentError:
            return value  # open_buffer says what is wrong with it
        if password:
            click.echo(
                "walbuf: warning: the buffer's URL holds a password, which every account of this host can read"
                " (ps, /proc) while walbuf runs; leave it out of the URL and put it in ~/.pgpass or $PGPASSWORD"
                " (see docs/postgresql.md)",
                err=True,
            )
    return value


@main.command(epilog=NOT_SYNCING_HELP)
@click.argument("buffer", callback=_buffer_given)
@click.option("--run", help="Only records of this run.")
@click.option("--writer", help="Only records of this writer.")
@click.option("--limit", type=click.IntRange(min=0), help="At most this many records.")
@click.option("--quarantined", is_flag=True, help="Only the records a sync quarantined, each with the reason.")
def records(buffer: str, run: str | None, writer: str | None, limit: int | None, quarantined: bool) -> None:
    """Print the records in BUFFER as JSON lines, in the order they were logged.

    NaN and infinities are printed as NaN, Infinity, -Infinity (as Python's
    json module reads them), a histogram as {"_type": "histogram", "values":
    COUNTS, "bins": EDGES}, an image as {"_type": "walbuf-image", "png":
    BASE64, "width": W, "height": H, "caption": TEXT}. A quarantined record (W&B refuses it for good,
    so it is never sent) has a "quarantined" field with the reason.
    Reading changes nothing.
    """
    with _errors():
        printed = 0
        for record in read(buffer, run=run, writer=writer, quarantined=quarantined):
            if limit is not None and printed >= limit:
                break
            click.echo(_json_line(record))
            printed += 1
        if not printed and (run is not None or writer is not None):
            check_names(buffer, run, writer)  # nothing of them: a name the buffer lacks is an error


def _finished_line(run: RunSync) -> str:
    """What a sync or a follow's pass says of a W&B run it finished."""
    if run.finished == 0:
        why = "every writer closed"
    else:
        names = ", ".join(repr(w) for w in run.failed_writers) or "a writer"
        why = f"{names} failed or died without closing"
    return f"  finished the W&B run with exit code {run.finished}: {why}"


def _target_text(run: RunSync) -> str:
    t = run.target
    where = "/".join(p for p in (t.entity, t.project) if p) or "(default project)"
    return f"{where}/{t.wandb_id or '(new run id)'}"


class _Seconds(click.ParamType):
    """A finite, positive number of seconds."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not (math.isfinite(seconds) and seconds > 0):
            self.fail(f"{value!r} is not a finite number of seconds above 0", param, ctx)
        return seconds


class _Age(click.ParamType):
    """An age: a number followed by s, m, h, d or w."""

    name = "age"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        try:
            return parse_age(str(value))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


def _sync_options(command: Any) -> Any:
    """The options of `walbuf sync`, which `walbuf-cron` takes too."""
    options = [
        click.argument("buffer", callback=_buffer_given),
        click.option(
            "--run",
            "run_name",
            metavar="NAME",
            help="Sync only this walbuf run (default: every run with pending records).",
        ),
        click.option("--project", help="W&B project (stored in the buffer at the first sync)."),
        click.option("--entity", help="W&B entity (stored in the buffer at the first sync)."),
        click.option("--run-id", help="W&B run id (default: the one stored, else a new one, then stored)."),
        click.option(
            "--mode",
            type=click.Choice(["online", "offline"]),
            default="online",
            show_default=True,
            help="online: upload to W&B. offline: write a wandb offline run directory for `wandb sync`.",
        ),
        click.option(
            "--dir",
            "directory",
            type=click.Path(file_okay=False),
            help="Where --mode offline writes (default: BUFFER.wandb/).",
        ),
        click.option(
            "--max-records",
            type=click.IntRange(min=1),
            help="Send at most this many records; the rest waits for the next sync.",
        ),
        click.option(
            "--max-seconds",
            type=_Seconds(),
            help=(
                "End the process within this many seconds of its start (plus at most 1), wandb's start and"
                " finish included; the rest waits for the next sync."
            ),
        ),
        click.option(
            "--wait",
            type=click.FloatRange(min=0),
            default=0,
            help="Wait this many seconds for another running sync of BUFFER (default: exit 11 at once).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


class _Progress:
    """What `walbuf sync` prints while it works, on stderr: each run and a progress bar (not when quiet), and
    warnings."""

    def __init__(self, quiet: bool, dry_run: bool) -> None:
        self.quiet, self.dry_run = quiet, dry_run
        self.bar: Any = None

    def on_run(self, run: RunSync) -> None:
        if run.possibly_duplicated and not self.dry_run:  # a warning: printed even when quiet
            click.echo(
                f"walbuf: warning: run {run.run}: {_records(run.possibly_duplicated)} were in an earlier"
                " upload that was cut off; they are sent again, and W&B may now hold them twice",
                err=True,
            )
        if self.quiet:
            return
        verb = "would send" if self.dry_run else "sending"
        writers = ", ".join(f"{w} {n}" for w, n in run.per_writer.items())
        click.echo(f"{run.run} -> {_target_text(run)}: {verb} {_records(run.records)} ({writers})", err=True)
        if run.possibly_duplicated and self.dry_run:
            click.echo(f"  {run.possibly_duplicated} of them were in an upload that was cut off", err=True)
        self.close()
        if not self.dry_run:
            self.bar = click.progressbar(length=run.records, file=sys.stderr, label="  uploading")
            self.bar.__enter__()

    def progress(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


@contextmanager
def _process_of_its_own(verbose: bool) -> Iterator[str]:
    """Settings for a process that the command owns, while it syncs.

    wandb prints its own notes ("Loaded credentials", "shared mode is
    experimental") unless WANDB_SILENT is set. It makes temporary folders at
    import that it never removes, and its service writes a debug log into
    $WANDB_CACHE_DIR (else ~/.cache/wandb/logs; wandb-core's
    observability/util.go) each time it starts: all of it goes into a
    folder of walbuf's, removed afterwards.
    """
    if not verbose:
        os.environ["WANDB_SILENT"] = "true"
    folder = tempfile.mkdtemp(prefix="walbuf-")
    tempfile.tempdir = folder
    for name in ("TMPDIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        os.environ[name] = folder
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _bound_process(options: dict[str, Any], folder: str, overrun: Callable[[str], int]) -> dict[str, Any]:
    """Hold the whole process to --max-seconds: the options for the sync, the bound made what is left of it.

    The bound counts from the process's start (Python's start and imports
    are in it); the sync's own hard stop ends the upload at the bound, and
    PROCESS_GRACE later the process ends whatever it waits for (wandb's
    teardown): wandb-core is killed, so that nothing more is sent once
    walbuf has said so, and ``overrun(why)`` says so and gives the exit code.
    """
    bound = options["max_seconds"]
    if bound is None:
        return options
    left = bound - process_age()
    why = (
        f"the time bound of {bound:g}s (--max-seconds) passed while wandb was ending; what W&B confirmed"
        " before is marked synced, the rest waits for the next sync"
    )

    def last_words() -> int:
        stop_uploads()
        shutil.rmtree(folder, ignore_errors=True)
        return overrun(why)

    end_process_after(left + PROCESS_GRACE, last_words)
    return {**options, "max_seconds": max(MIN_SECONDS_LEFT, left)}


def _sync_overrun(why: str) -> int:
    sys.stderr.write(f"walbuf: error: {why}; retry later\n")
    sys.stderr.flush()
    return exitcodes.TEMPFAIL.code


def _run_sync(
    options: dict[str, Any],
    *,
    dry_run: bool,
    quiet: bool,
    verbose: bool = False,
    overrun: Callable[[str], int] = _sync_overrun,
) -> SyncResult:
    """Call walbuf.sync with the command's options; print its warnings (even when quiet)."""
    shown = _Progress(quiet, dry_run)
    try:
        with _process_of_its_own(verbose) as folder:
            if not dry_run:
                options = _bound_process(options, folder, overrun)
            result = sync_buffer(
                options["buffer"],
                run=options["run_name"],
                project=options["project"],
                entity=options["entity"],
                run_id=options["run_id"],
                mode=options["mode"],
                directory=options["directory"],
                max_records=options["max_records"],
                max_seconds=options["max_seconds"],
                wait=options["wait"],
                dry_run=dry_run,
                take_over=options.get("take_over", False),
                progress=shown.progress,
                on_run=shown.on_run,
            )
    finally:
        shown.close()
    for message in result.refused:
        click.echo(f"walbuf: warning: {message}", err=True)
    for run in result.runs:
        _say_warnings(run, options["buffer"])
    return result


def _say_warnings(run: RunSync, buffer: str) -> None:
    """On stderr, what a sync or a follow's pass warns of a run it synced (printed even when quiet)."""
    for c in run.config_changes:
        click.echo(
            f"walbuf: warning: run {run.run}: config {c.key!r} was {c.old_value!r} (from {c.old_writer})"
            f" and was set again to {c.new_value!r} (by {c.new_writer}): W&B gets the later value",
            err=True,
        )
    for q in run.quarantined[:QUARANTINE_SHOWN]:
        click.echo(f"walbuf: warning: run {run.run}: quarantined {q.writer} step {q.step}: {q.reason}", err=True)
    if len(run.quarantined) > QUARANTINE_SHOWN:
        click.echo(
            f"walbuf: warning: run {run.run}: and {len(run.quarantined) - QUARANTINE_SHOWN} more records quarantined",
            err=True,
        )
    if run.quarantined:
        click.echo(
            f"walbuf: warning: run {run.run}: {_records(len(run.quarantined))} quarantined: never sent, kept in the"
            f" buffer; see them with `walbuf records {_shown(buffer)} --quarantined`",
            err=True,
        )
    for r in run.refused_settings:
        click.echo(
            f"walbuf: warning: run {run.run}: {r.kind} {r.key!r} (from {r.writer}) left out: {r.reason}", err=True
        )


def _say_done(run: RunSync, stamp: str = "") -> None:
    """What a sync or a follow's pass says of a run it synced: its records, its finish, its offline folder."""
    click.echo(f"{stamp}{run.run} -> {_target_text(run)}: {_records(run.records)} synced")
    if run.finished is not None:
        click.echo(_finished_line(run))
    if run.offline_dir:
        click.echo(f"  upload it later with: wandb sync {run.offline_dir}")


@main.command(epilog=EXIT_HELP)
@_sync_options
@click.option("--dry-run", is_flag=True, help="Say what would be sent; send and change nothing.")
@click.option(
    "--quiet", "-q", is_flag=True, help="Print nothing but errors and warnings that need a person (for cron)."
)
@click.option("--verbose", "-v", is_flag=True, help="Also show wandb's own messages (silenced otherwise).")
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help=(
        "Stream records as they are logged, until every writer has closed and all is delivered"
        " (BUFFER may not exist yet)."
    ),
)
@click.option(
    "--interval",
    type=_Seconds(),
    default=DEFAULT_INTERVAL,
    show_default=True,
    help="With --follow: seconds between passes.",
)
@click.option(
    "--take-over",
    is_flag=True,
    help=(
        "Make this host the one that syncs BUFFER, where only one may (a directory buffer on a filesystem whose"
        " locks do not span hosts): only once the other host syncs it no more."
    ),
)
def sync(
    dry_run: bool, quiet: bool, verbose: bool, follow: bool, interval: float, take_over: bool, **options: Any
) -> None:
    """Replay BUFFER's records not yet synced into W&B, one shared-mode run per walbuf run.

    A record is marked synced only after W&B confirmed its upload. In W&B,
    writer W's metric K is logged as P/K, on the step axis P/<step_axis>,
    where the prefix P is W unless the writer set another ("": none).
    """
    if take_over and (follow or dry_run):
        raise click.UsageError("--take-over is for one sync: run `walbuf sync --take-over BUFFER` once, on its own")
    options["take_over"] = take_over
    if follow:
        _follow(options, interval, quiet=quiet, verbose=verbose, dry_run=dry_run)
        return
    if not quiet:
        _say_what_walbuf_waits_for()
    with _errors():
        result = _run_sync(options, dry_run=dry_run, quiet=quiet, verbose=verbose)
    if quiet:
        if result.needs_a_person:
            sys.exit(exitcodes.QUARANTINED.code)
        return
    if result.stopped_early:
        click.echo("stopped at the --max-records or --max-seconds bound; the rest waits for the next sync")
    elif not result.runs and not result.not_in_hub:
        click.echo("nothing to sync")
    for run in result.runs:
        if not dry_run:
            _say_done(run)
    if dry_run:
        click.echo(f"dry run: {_records(result.records)} would be sent; nothing was changed")
    if result.not_in_hub:
        click.echo(f"  and {_records(result.not_in_hub)} of shards not yet in the hub, which a sync copies in first")
    if result.unreadable_shards:
        click.echo(
            f"  {result.unreadable_shards} live shards of an older walbuf on other hosts are not readable from"
            " here until they are sealed (see walbuf status)"
        )
    if result.needs_a_person:
        sys.exit(exitcodes.QUARANTINED.code)


@click.command(epilog=EXIT_HELP)
@click.version_option(__version__, prog_name="walbuf-cron")
@_sync_options
def cron(**options: Any) -> None:
    """Run one bounded `walbuf sync BUFFER --quiet` from cron, and log one line about it.

    Takes the options of `walbuf sync`; --max-seconds defaults to 540, which
    ends a sync before the next one of a 10-minute crontab starts. What a
    later run can fix by itself (W&B or the buffer's server unreachable,
    another sync still running) is logged and exits 0; anything else keeps
    its exit code, so that cron mails it. Install it with walbuf and give
    cron its full path: it needs nothing on cron's PATH.
    """
    _stop_cleanly_on_signals()
    if options["max_seconds"] is None:
        options["max_seconds"] = CRON_MAX_SECONDS
    buffer = _shown(options["buffer"])
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")

    def overrun(why: str) -> int:
        sys.stdout.write(f"{stamp} walbuf sync {buffer}: exit {exitcodes.TEMPFAIL.code}, will retry: {why}\n")
        sys.stdout.flush()
        return 0

    try:
        result = _run_sync(options, dry_run=False, quiet=True, overrun=overrun)
    except WalbufError as exc:
        code = exitcodes.for_error(exc)
        then = "will retry" if code.retry else "needs a person"
        click.echo(f"{stamp} walbuf sync {buffer}: exit {code.code}, {then}: {_one_line(exc)}")
        sys.exit(0 if code.retry else code.code)
    except KeyboardInterrupt as exc:
        code = exitcodes.SIGTERM if isinstance(exc, _Terminated) else exitcodes.SIGINT
        click.echo(f"{stamp} walbuf sync {buffer}: exit {code.code}: {code.meaning}")
        sys.exit(code.code)
    if result.needs_a_person:
        click.echo(
            f"{stamp} walbuf sync {buffer}: exit {exitcodes.QUARANTINED.code}, needs a person:"
            f" {_records(result.records)} synced, {result.quarantined} quarantined,"
            f" {len(result.refused)} parts not taken in (see the warnings above)"
        )
        sys.exit(exitcodes.QUARANTINED.code)
    click.echo(f"{stamp} walbuf sync {buffer}: ok, {_records(result.records)} synced")


def _shown(buffer: str) -> str:
    """A buffer as given, for a log line: a URL's password masked, as every message of walbuf's does."""
    if "://" not in buffer:
        return buffer
    try:
        return sa.make_url(buffer).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "(a buffer URL walbuf cannot read)"


@main.command(epilog=NOT_SYNCING_HELP)
@click.argument("buffer", callback=_buffer_given)
@click.option("--json", "as_json", is_flag=True, help="Print JSON: per run and writer, records and pending counts.")
def status(buffer: str, as_json: bool) -> None:
    """Show BUFFER's runs, writers, records, pending records and last sync. Changes nothing."""
    with _errors():
        report = buffer_status(buffer)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(f"buffer {report.buffer}")
    for shard in report.shards:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(shard.created_at))
        if shard.refused is not None:
            waiting = f"not taken in whole (see walbuf doctor): {shard.refused}"
        elif shard.not_in_hub is None:
            waiting = "not readable from this host"
        else:
            waiting = f"{_records(shard.not_in_hub)} not yet in the hub"
        click.echo(f"shard {shard.shard} ({shard.state}, since {created}): {waiting}")
    for damaged in report.damaged_shards:
        click.echo(f"shard {damaged} (set aside in quarantine/ by an older walbuf: see walbuf doctor)")
    for why in report.not_opened:
        click.echo(f"not opened: {why}")
    if not report.runs:
        click.echo("  no runs yet")
    for run in report.runs:
        target = Target(run.wandb_id, run.project, run.entity).shown()
        held = f", {run.quarantined} quarantined" if run.quarantined else ""
        click.echo(f"run {run.run} -> W&B {target}: {_records(run.records)}, {run.pending} pending{held}")
        if run.target_refused:
            click.echo(f"  not sent: W&B refused its target: {run.target_refused}")
        if run.finished_exit is not None:
            click.echo(f"  the W&B run is finished, with exit code {run.finished_exit}")
        for w in run.writers:
            last = "-" if w.last_step is None else w.last_step
            held = f", {w.quarantined} quarantined" if w.quarantined else ""
            click.echo(
                f"  {w.writer:<24} {w.records:>9} records {w.pending:>9} pending"
                f"  axis {w.step_axis}, last step {last}{held}"
            )
        if run.last_sync is None:
            click.echo("  never synced")
        else:
            s = run.last_sync
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.finished_at or s.started_at))
            detail = f": {s.message}" if s.message else ""
            click.echo(f"  last sync {when} ({s.mode}): {s.status}, {_records(s.records)}{detail}")


@main.command(epilog=NOT_SYNCING_HELP)
@click.argument("buffer", callback=_buffer_given)
@click.option(
    "--older-than",
    required=True,
    type=_Age(),
    metavar="AGE",
    help="Only records logged longer ago than this: 90s, 30m, 12h, 7d, 2w.",
)
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
def prune(buffer: str, older_than: float, quiet: bool) -> None:
    """Delete BUFFER's synced records older than AGE, then reclaim the space.

    Records not yet confirmed uploaded are never deleted.
    """
    with _errors():
        result = prune_buffer(buffer, older_than=older_than)
    for message in result.shards_kept:
        click.echo(f"walbuf: warning: {message}", err=True)
    if not quiet:
        click.echo(
            f"deleted {result.deleted} synced records"
            + (f" and {result.shards_removed} ingested shards" if result.shards_removed else "")
            + f"; {result.bytes_before:,} -> {result.bytes_after:,} bytes"
        )


@main.command(epilog=NOT_SYNCING_HELP)
@click.argument("buffer", callback=_buffer_given)
def doctor(buffer: str) -> None:
    """Check BUFFER: integrity, journal mode, schema, pending records, syncs cut off or failed.

    Changes nothing. Exits 1 if something needs a person, and says what to do.
    """
    with _errors():
        report = examine(buffer)
    click.echo(f"buffer {report.buffer}")
    for f in report.findings:
        click.echo(f"  {'ok  ' if f.ok else 'FAIL'}  {f.check}: {f.detail}")
        if f.advice:
            click.echo(f"        -> {f.advice}")
    if not report.healthy:
        sys.exit(exitcodes.ERROR.code)


GC_YOUNG = 10_000  # objects allocated between collections of the youngest generation (Python's default: 700)


def run() -> None:
    """The `walbuf` program (and `python -m walbuf`): main() in a process of its own."""
    _own_process()
    main()


def run_cron() -> None:
    """The `walbuf-cron` program: cron() in a process of its own."""
    _own_process()
    cron()


def _own_process() -> None:
    # The objects imported so far live as long as the process: taken out of
    # the garbage collector's reach, they are not traversed again by each
    # full collection, of which importing wandb and handing rows over to it
    # make many. A 20,000-row sync used about 0.7 s less CPU
    # (docs/performance.md). Only for a process the command owns: tests call
    # main() in theirs.
    gc.freeze()
    # And a young-generation collection after 10,000 new objects, not 700:
    # importing wandb and handing rows over allocate far more than they
    # leave behind, and each collection that finds nothing still walks what
    # is new. A 20,000-row sync: 0.93x the wall time, 0.95x the CPU
    # (docs/performance.md). Cyclic garbage waits that much longer for a
    # collection; reference counting frees the rest as before.
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
