"""Functions that run in child processes of the tests (importable by spawn and forkserver)."""

from __future__ import annotations

import os
import sys

import walbuf


def set_env(name: str, value: str) -> None:
    """Pool initializer: configure walbuf through the environment of the worker."""
    os.environ[name] = value


def log_n(writer: walbuf.Writer, n: int) -> str:
    """Log n records through ``writer`` and return the writer id this process used."""
    for i in range(n):
        writer.log({"i": i, "pid": os.getpid()})
    name = writer.writer
    writer.close()
    return name


def log_n_exit_code(writer: walbuf.Writer, n: int) -> None:
    """Process target: exit 3 on WriterConflictError, 0 after logging."""
    try:
        log_n(writer, n)
    except walbuf.WriterConflictError:
        sys.exit(3)


def concurrent_writer(buffer: str, index: int, n: int, go: object) -> None:
    """Process target: open a writer, wait for the start signal, log n records."""
    writer = walbuf.init(buffer, writer=f"w{index:02d}", run="many")
    go.wait()  # type: ignore[attr-defined]
    for i in range(n):
        walbuf.log({"i": i, "loss": 1.0 / (i + 1)})
    writer.close()


def starting_writer(buffer: str, index: int, n: int, go: object) -> None:
    """Process target: wait for the start signal, then open a writer (as a job's ranks start together), log n
    records, close."""
    go.wait()  # type: ignore[attr-defined]
    with walbuf.Writer(buffer, writer=f"w{index:02d}", run="many") as writer:
        for i in range(n):
            writer.log({"i": i})


@walbuf.logged(writer="eval", step_axis="eval_step", run="pool")
def evaluate(checkpoint: int) -> dict[str, object]:
    """A decorated evaluation, configured from WALBUF_BUFFER in the worker."""
    return {"train_step": checkpoint, "eval/accuracy": checkpoint / 100, "pid": os.getpid()}
