"""A log() a Ctrl-C interrupts (issue 51): its record is stored once or not at all, and the writer logs on.

The interruptions come from outside walbuf, as real signals. strace
delivers SIGINT to the writer process (tests/interrupted_writer.py, which
logs again after each KeyboardInterrupt, as a notebook user does) as its
main thread enters its Nth call of a syscall (``-e
inject=SYSCALL:signal=SIGINT:when=N``), so that Python raises
KeyboardInterrupt at the next point it looks for signals: between a commit
or a write and log()'s return, inside a clean-up, between two writes of a
frame. strace follows the main thread only (no -f): it counts calls per
thread, and a signal it delivered to another thread (the one a transaction
runs in) would land in the main thread at a point no count tells. The N are
spread over the calls the writer's loop makes, counted in a clean run
first: a handful for each syscall here; WALBUF_INTERRUPT_SWEEP=all tries
each one. tests/traced_writer.py reaches the points strace cannot: it
raises SIGINT itself wherever Python looks for signals.

After each run, with the writer still open (a notebook's process goes on):

- every log() that returned has its record at its step, once, and no step
  holds two records;
- the buffer takes a write transaction from another connection at once
  (SQLite: BEGIN IMMEDIATE with no busy wait; PostgreSQL: no session of the
  writer's is idle inside a transaction): the writer left none open;
- a directory buffer: doctor finds nothing wrong (no shard damaged), and
  its records read whole;

then it closes, and the records are the same.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import fresh_buffer, require_postgres, require_strace, rows_of, stopped_by_strace

import walbuf
from walbuf.directory import frames

pytestmark = pytest.mark.slow  # a process under strace per run

TESTS = Path(__file__).parent
RECORDS = 12  # each interrupted_writer.py run logs these
SWEEP = os.environ.get("WALBUF_INTERRUPT_SWEEP") == "all"
PER_SYSCALL = 4  # N values tried per syscall, without the sweep
WAIT = 120  # seconds a writer process may take before the test fails (a hang is a failure, never a pass)

# The syscalls each kind's log() makes in the writer's main thread: SQLite's
# reads, writes and locks of its files, a directory buffer's frame writes,
# PostgreSQL's socket. (The main thread's wait for a transaction run in a
# thread of its own, walbuf.store.interrupts, makes none strace counts the
# same in every run: traced_writer.py interrupts it.)
SYSCALLS = {
    "sqlite": ("pwrite64", "fcntl", "pread64"),
    "directory": ("write",),
    "postgresql": ("sendto", "recvfrom", "poll"),
}


@contextmanager
def new_buffer(kind: str) -> Iterator[str]:
    """A buffer of ``kind`` that does not exist yet, as a location interrupted_writer.py takes."""
    if kind == "directory":
        with tempfile.TemporaryDirectory() as tmp:
            yield str(Path(tmp) / "exp") + "/"
        return
    if kind == "postgresql":
        require_postgres()
    with fresh_buffer(kind) as location:
        if kind == "postgresql":
            # Its sessions are found by name in pg_stat_activity (see no_transaction_open).
            location = f"{location}&application_name=walbuf-{uuid.uuid4().hex[:12]}"
        yield str(location)


def writer_command(buffer: str, *flags: str) -> list[str]:
    return [sys.executable, str(TESTS / "interrupted_writer.py"), buffer, str(RECORDS), *flags]


def clean_trace(kind: str, syscalls: tuple[str, ...], *flags: str) -> list[tuple[str, str]]:
    """A clean run of the writer under strace: the main thread's calls of ``syscalls`` in its loop, in order, each
    as (name, the rest of strace's line)."""
    strace = require_strace()
    with new_buffer(kind) as buffer, tempfile.NamedTemporaryFile("r") as trace:
        command = [strace, "-qq", "-o", trace.name, "-e", f"trace=getppid,{','.join(syscalls)}"]
        proc = subprocess.run(
            [*command, *writer_command(buffer, *flags)], input="\n", capture_output=True, text=True, timeout=WAIT
        )
        assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr
        lines = trace.read().splitlines()
    calls, marks = [], 0
    for line in lines:
        name = re.match(r"(\w+)\(", line)
        if name is None:
            continue  # a signal strace noted
        if name.group(1) == "getppid":
            marks += 1
        elif marks == 1:
            calls.append((name.group(1), line))
        elif marks == 0:
            calls.append(("before the loop", name.group(1)))
    assert marks == 2, lines[-20:]
    return calls


def loop_calls(kind: str, syscall: str, *flags: str) -> list[int]:
    """The numbers (as strace's when= counts them in the main thread) of the calls of ``syscall`` that a clean run
    of the writer makes in its loop."""
    calls = clean_trace(kind, (syscall,), *flags)
    before = sum(1 for name, what in calls if name == "before the loop" and what == syscall)
    return [before + i + 1 for i, (name, _) in enumerate(c for c in calls if c[0] == syscall)]


def spread(calls: list[int], count: int = PER_SYSCALL) -> list[int]:
    """``count`` of ``calls`` spread evenly from the first to the last (every one with the sweep)."""
    if SWEEP or len(calls) <= count:
        return calls
    return sorted({calls[round(i * (len(calls) - 1) / (count - 1))] for i in range(count)})


@dataclass
class Outcome:
    """What an interrupted_writer.py run printed, and what was wrong with the buffer while it was open."""

    acked: list[tuple[int, int]]  # (seq, step) of each log() that returned
    caught: list[str]  # the names of the exceptions it caught, in order
    problems: list[str] = field(default_factory=list)


def run_interrupted(kind: str, buffer: str, syscall: str, inject: str, *flags: str) -> Outcome:
    """interrupted_writer.py logging into ``buffer`` while strace injects ``inject`` (after ``syscall``=); the
    buffer examined while it is open, and again once it closed."""
    strace = require_strace()
    command = [strace, "-qq", "-o", os.devnull, "-e", f"trace={syscall}", "-e", f"inject={syscall}:{inject}"]
    proc = subprocess.Popen(
        [*command, *writer_command(buffer, *flags)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(WAIT, proc.kill)  # a writer that hangs fails the test (it never passes by waiting)
    watchdog.start()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        if not line.startswith("done "):
            out, err = proc.communicate()
            pytest.fail(f"{inject}: the writer did not finish its loop ({line}{out}): {err[-3000:]}")
        printed = json.loads(line.removeprefix("done "))
        outcome = Outcome([(seq, step) for seq, step in printed["acked"]], printed["caught"])
        outcome.problems += [f"while open: {p}" for p in examine(kind, buffer, outcome, flags)]
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, err = proc.communicate()
        if proc.returncode != 0 or "closed" not in out:
            outcome.problems.append(f"the writer did not close (exit {proc.returncode}): {err[-3000:]}")
        outcome.problems += [f"after close: {p}" for p in records_problems(buffer, outcome, flags)]
        return outcome
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def examine(kind: str, buffer: str, outcome: Outcome, flags: tuple[str, ...]) -> list[str]:
    """What is wrong with the buffer of an open writer that was interrupted."""
    problems = records_problems(buffer, outcome, flags)
    if kind == "sqlite":
        problems += sqlite_write_lock(buffer)
    elif kind == "postgresql":
        problems += open_transactions(buffer)
    else:
        report = walbuf.doctor(buffer)
        problems += [f"doctor: {f.check}: {f.detail}" for f in report.findings if not f.ok]
    return problems


def records_problems(buffer: str, outcome: Outcome, flags: tuple[str, ...], records: int | None = RECORDS) -> list[str]:
    """Each acknowledged record at its step once (and ``records`` of them); with auto steps, no step twice; with
    explicit ones, each record at the step of its seq."""
    stored = [(r.step, r.metrics["seq"]) for r in walbuf.read(buffer, run="r", writer="w")]
    problems = []
    if records is not None and len(outcome.acked) != records:
        problems.append(f"{len(outcome.acked)} of {RECORDS} records acknowledged")
    for seq, step in outcome.acked:
        at_step = [s for st, s in stored if st == step]
        if "explicit" in flags:
            at_step = at_step[-1:]  # a stored record of an interrupted log() may be before it, at the same step
        if at_step != [seq]:
            problems.append(f"step {step}, acknowledged for seq {seq}, holds {at_step}")
    steps = [st for st, _ in stored]
    if steps != sorted(steps):
        problems.append(f"steps out of order: {steps}")
    if "explicit" in flags:
        problems += [f"seq {s} stored at step {st}" for st, s in stored if st != s]
    else:
        problems += [f"step {st} holds {n} records" for st, n in collections.Counter(steps).items() if n > 1]
    return problems


def sqlite_write_lock(buffer: str) -> list[str]:
    conn = sqlite3.connect(buffer, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
    except sqlite3.OperationalError as exc:
        return [f"another connection cannot begin a write transaction ({exc}): the writer left one open"]
    finally:
        conn.close()
    return []


def open_transactions(buffer: str) -> list[str]:
    name = sa.make_url(buffer).query["application_name"]
    engine = sa.create_engine(buffer, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT state, query FROM pg_stat_activity"
                    " WHERE application_name = :name AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
                ),
                {"name": name},
            ).all()
    finally:
        engine.dispose()
    return [f"a session of the writer is inside a transaction ({state}: {query})" for state, query in rows]


def interrupted_runs(kind: str, syscall: str, injections: list[str], *flags: str) -> list[Outcome]:
    """One run of the writer per injection (``signal=...:when=...``), each into a new buffer; fails the test with
    every problem any of them found."""
    outcomes, failures = [], {}
    for inject in injections:
        with new_buffer(kind) as buffer:
            outcome = run_interrupted(kind, buffer, syscall, inject, *flags)
        outcomes.append(outcome)
        if outcome.problems:
            failures[inject] = outcome.problems
    assert not failures, failures
    return outcomes


CASES = [(kind, syscall) for kind, syscalls in SYSCALLS.items() for syscall in syscalls]


@pytest.mark.parametrize(("kind", "syscall"), CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_a_log_interrupted_anywhere_stores_its_record_once_or_not_at_all_and_leaves_the_buffer_whole(kind, syscall):
    calls = loop_calls(kind, syscall)
    outcomes = interrupted_runs(kind, syscall, [f"signal=SIGINT:when={n}" for n in spread(calls)])
    assert any("KeyboardInterrupt" in o.caught for o in outcomes)  # the injections reached log() calls


# Two interruptions K calls apart: the second lands in what the first set
# going, a clean-up above all (the rollback of a transaction, the close of a
# connection, the cut back of a frame).
TWICE = [("sqlite", "fcntl"), ("sqlite", "pwrite64"), ("directory", "write"), ("postgresql", "sendto")]


@pytest.mark.parametrize(("kind", "syscall"), TWICE, ids=[f"{k}-{s}" for k, s in TWICE])
def test_a_second_interruption_in_the_clean_up_of_the_first_leaves_no_transaction_open_and_no_record_twice(
    kind, syscall
):
    calls = loop_calls(kind, syscall)
    # Both within the loop: the writer's close is not what is asked of it here.
    injections = [f"signal=SIGINT:when={n}..{n + k}+{k}" for k in (1, 3) for n in spread(calls[:-k], 3)]
    outcomes = interrupted_runs(kind, syscall, injections)
    assert any(o.caught.count("KeyboardInterrupt") >= 2 for o in outcomes)


def test_a_retry_with_an_explicit_step_after_an_interruption_logs_at_that_step():
    calls = loop_calls("sqlite", "pwrite64", "explicit")
    outcomes = interrupted_runs("sqlite", "pwrite64", [f"signal=SIGINT:when={n}" for n in spread(calls)], "explicit")
    assert any("KeyboardInterrupt" in o.caught for o in outcomes)


def test_a_frame_an_interruption_cut_short_is_cut_back_before_the_next_one():
    # The live shard may grow only so far: the write that reaches the limit
    # writes part of its frame and returns, and the interruption comes before
    # the write of the rest; room is given back before the record is logged
    # again.
    limit = "fsize=150"
    calls = clean_trace("directory", ("write",), limit)
    writes = [text for name, text in calls if name == "write"]
    short = next(i for i, text in enumerate(writes) if (m := re.search(r", (\d+)\) += (\d+)$", text)) and m[1] != m[2])
    before = sum(1 for name, what in calls if name == "before the loop" and what == "write")
    (outcome,) = interrupted_runs("directory", "write", [f"signal=SIGINT:when={before + short + 1}"], limit)
    assert outcome.caught[0] == "KeyboardInterrupt", outcome.caught


@pytest.mark.parametrize("kind", ["sqlite", "directory", "postgresql"])
def test_one_or_two_interruptions_wherever_python_looks_for_signals_leave_no_transaction_open_nor_a_record_twice(kind):
    # traced_writer.py interrupts itself at every point of a log() of a new
    # key, a log() of known keys and a flush() where CPython would run a
    # signal's handler, alone and with a second interruption after it.
    with new_buffer(kind) as buffer:
        proc = subprocess.run(
            [sys.executable, str(TESTS / "traced_writer.py"), buffer, "0"],
            capture_output=True,
            text=True,
            timeout=WAIT * 5,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout)
        assert result["problems"] == []
        assert result["raised"] == []  # each interrupted call raised KeyboardInterrupt, and nothing else
        assert result["interrupted"] > sum(result["events"].values())
        acked = Outcome([(seq, step) for seq, step in result["acked"]], [])
        assert records_problems(buffer, acked, (), records=None) == []
        if kind == "directory":
            report = walbuf.doctor(buffer)
            assert [f for f in report.findings if not f.ok] == []


def test_a_failed_fsync_leaves_the_frame_a_sync_took_in_and_every_acknowledged_record_arrives_once(in_process):
    # A writer with durability="fsync" on a directory buffer: the fsync of one
    # record's frame fails (EIO) and the writer stops there (SIGSTOP, from
    # strace, as the fsync returns), its frame whole in the live shard; a
    # sync on this host takes it in, then the writer goes on. A record logged
    # again after an error is longer, so that a frame cut off and written
    # again would not end where the first ended.
    strace = require_strace()
    fsyncs = loop_calls("directory", "fsync", "fsync")
    failing = fsyncs[len(fsyncs) // 2]  # the fsync of the record at step SEQ, SEQ below (one fsync per record)
    seq = fsyncs.index(failing)
    with tempfile.TemporaryDirectory() as tmp:
        buffer, trace = str(Path(tmp) / "exp") + "/", Path(tmp) / "trace"
        inject = f"inject=fsync:error=EIO:signal=SIGSTOP:when={failing}"
        command = [strace, "-f", "-qq", "-o", str(trace), "-e", "trace=fsync", "-e", inject]
        proc = subprocess.Popen(
            [*command, *writer_command(buffer, "fsync")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # strace notes the stop it keeps the writer in once the signal came
            # (its first line is the writer's main thread: its pid)
            writer = stopped_by_strace(trace, "the writer did not stop at its failing fsync")
            first = walbuf.sync(buffer)
            (fake_run,) = (in_process.run(r.target.wandb_id) for r in first.runs)
            assert [step for step, _ in rows_of(fake_run, "w")] == list(range(seq + 1))  # its frame too
            os.kill(writer, signal.SIGCONT)
            assert proc.stdout is not None and proc.stdin is not None
            printed = json.loads(proc.stdout.readline().removeprefix("done "))
            proc.stdin.write("\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=WAIT)
            assert proc.returncode == 0 and "closed" in out, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        second = walbuf.sync(buffer)
        assert second.refused == () and not second.needs_a_person
        arrived = [(metrics["seq"], step) for step, metrics in rows_of(fake_run, "w")]
        assert sorted(set(arrived)) == arrived  # none twice, in order
        # Each acknowledged record, and the one whose fsync failed (stored, not durable), at its step.
        assert {(s, step) for s, step in printed["acked"]} | {(seq, seq)} == set(arrived)
        assert walbuf.doctor(buffer).healthy
        assert printed["caught"] == ["RecordNotDurableError"]  # the record was stored, not made durable


def frame_kinds(shard: Path) -> list[str]:
    """The kinds of the whole frames of a shard file, in order, as letters (P, W, R, ..., E for END)."""
    fd = os.open(shard, os.O_RDONLY)
    try:
        return [chr(item.kind) for item in frames.FrameReader(fd) if isinstance(item, frames.Frame)]
    finally:
        os.close(fd)


def test_a_shard_whose_fsync_failed_is_never_sealed_by_its_process_and_a_sync_here_seals_it_once_it_ended(
    in_process,
):
    # Sealing appends END and fsyncs again: Linux reports a failed writeback
    # to one fsync only, so that one would pass, and a power loss could take
    # the page that failed from the middle of a shard marked whole. So the
    # shard is left as it is, live, until its process has ended.
    strace = require_strace()
    fsyncs = loop_calls("directory", "fsync", "fsync")
    failing = fsyncs[len(fsyncs) // 2]  # the fsync of the record at step SEQ, SEQ below (one fsync per record)
    seq = fsyncs.index(failing)
    with tempfile.TemporaryDirectory() as tmp:
        buffer = str(Path(tmp) / "exp") + "/"
        command = [
            strace,
            "-f",
            "-qq",
            "-o",
            os.devnull,
            "-e",
            "trace=fsync",
            "-e",
            f"inject=fsync:error=EIO:when={failing}",
        ]
        proc = subprocess.Popen(
            [*command, *writer_command(buffer, "fsync")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            printed = json.loads(proc.stdout.readline().removeprefix("done "))
            assert printed["caught"] == ["RecordNotDurableError"]
            # The writer is still open: the shard whose fsync failed, and the one it went on in.
            old, new = sorted(Path(buffer, "live").glob("*/*.log"))
            assert "E" not in frame_kinds(old)
            proc.stdin.write("\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=WAIT)
            assert proc.returncode == 0 and "closed" in out, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        # Its process sealed the shard it went on in, never the one whose fsync failed.
        assert sorted(Path(buffer, "live").glob("*/*.log")) == [old]
        assert frame_kinds(old)[-1] != "E"
        synced = walbuf.sync(buffer)
        assert not synced.needs_a_person
        assert list(Path(buffer, "live").glob("*/*.log")) == []  # sealed by the sync, its process having ended
        (fake_run,) = (in_process.run(r.target.wandb_id) for r in synced.runs)
        arrived = [(metrics["seq"], step) for step, metrics in rows_of(fake_run, "w")]
        assert sorted(set(arrived)) == arrived  # none twice, in order
        # Each acknowledged record, and the one whose fsync failed (stored, not durable, logged again), at its step.
        assert {(s, step) for s, step in printed["acked"]} | {(seq, seq)} == set(arrived)
        assert walbuf.doctor(buffer).healthy


def test_a_new_shard_whose_folder_cannot_be_made_fails_the_log_with_walbufs_error_and_stores_nothing(monkeypatch):
    # A shard rotated at every frame: each log() makes (or finds) the
    # buffer's folders for the new one, and one of those mkdir calls fails
    # for want of room. The log() raises BufferFullError, a StorageError, as
    # a failed write does (never a raw OSError, which the heartbeat would not
    # catch), goes on in the shard it had, and the record logged again is
    # stored once.
    monkeypatch.setenv("WALBUF_ROTATE_SECONDS", "0.000001")
    mkdirs = loop_calls("directory", "mkdir")
    (outcome,) = interrupted_runs("directory", "mkdir", [f"error=ENOSPC:when={mkdirs[len(mkdirs) // 2]}"])
    assert outcome.caught == ["BufferFullError"]
