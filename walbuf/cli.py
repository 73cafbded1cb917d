"""The `walbuf` command: a thin skin over the library. It parses arguments and calls walbuf."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from . import __version__
from .errors import (
    BufferCorruptError,
    BufferNotFoundError,
    ConfigError,
    SchemaTooNewError,
    WalbufError,
)
from .storage import read

# Exit codes (sysexits.h where one fits); README lists them.
EXIT_OK = 0
EXIT_ERROR = 1  # any other walbuf error
EXIT_USAGE = 2  # bad arguments (click's own code)
EXIT_DATAERR = 65  # buffer corrupt, or written by a newer walbuf
EXIT_NOINPUT = 66  # buffer does not exist
EXIT_CONFIG = 78  # unusable setting (bad URL, ...)

EXIT_CODES: list[tuple[type[WalbufError], int]] = [
    (BufferNotFoundError, EXIT_NOINPUT),
    (BufferCorruptError, EXIT_DATAERR),
    (SchemaTooNewError, EXIT_DATAERR),
    (ConfigError, EXIT_CONFIG),
    (WalbufError, EXIT_ERROR),
]

EXIT_HELP = """\b
Exit codes:
  0   success
  1   other error (the message says what to do)
  2   bad command-line usage
  65  buffer is corrupt or from a newer walbuf
  66  buffer does not exist
  78  unusable setting (bad buffer URL, ...)
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
    emit: Callable[[str], None] = click.echo
    with _errors():
        for n, record in enumerate(read(buffer, run=run, writer=writer)):
            if limit is not None and n >= limit:
                break
            emit(_json_line(record))
