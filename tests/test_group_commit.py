"""Group commit of a SQLite buffer: whoever has the turn commits the records others wait with, each exactly once.

What a writer process that died leaves in the group file (walbuf.store.group_commit) is planted here as it
would leave it, the test standing in for the writer still waiting on its record (it holds that slot's lock);
then a real Writer takes the turn.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import selectors
import signal
import sqlite3
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import walbuf
from walbuf.store import group_commit as gc

SLOT = 5  # the planted slot: Writers claim the lowest free ones


def group_file(buffer: Path) -> Path:
    return buffer.with_name(buffer.name + ".locks") / gc.NAME


def lock_byte(fd: int, byte: int, kind: int = fcntl.F_WRLCK) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", kind, os.SEEK_SET, byte, 1, 0))


def take_turn(buffer: Path) -> int:
    """Hold the buffer's turn, as a writer whose transaction takes long holds it; the descriptor it is held by."""
    fd = os.open(group_file(buffer), os.O_RDWR)
    lock_byte(fd, 0)
    os.pwrite(fd, b"\1", gc.HELD)
    return fd


def give_turn(fd: int) -> None:
    os.pwrite(fd, b"\0", gc.HELD)
    lock_byte(fd, 0, fcntl.F_UNLCK)


def new_buffer(tmp_path: Path) -> Path:
    """A buffer with its group file, and a record of writer "dead" at step 0."""
    buffer = tmp_path / "b.db"
    with walbuf.Writer(buffer, writer="dead", run="r") as w:
        w.log({"x": 0})
    assert group_file(buffer).stat().st_size == gc.SIZE
    return buffer


def records_of(buffer: Path, writer: str) -> list[tuple[int, dict]]:
    return [(r.step, r.metrics) for r in walbuf.read(buffer) if r.writer == writer]


def stored_row(buffer: Path, writer: str) -> tuple[int, tuple]:
    """The id and (writer_id, step, time, metrics) of ``writer``'s last record, as SQLite holds it."""
    with sqlite3.connect(buffer) as conn:
        return conn.execute(
            "SELECT records.id, writer_id, step, time, metrics FROM records JOIN writers ON writers.id = writer_id"
            " WHERE writers.name = ? ORDER BY records.id DESC LIMIT 1",
            (writer,),
        ).fetchone()


class Slot:
    """A slot of the group file, held by this test as by a writer waiting on its record."""

    def __init__(self, buffer: Path, index: int, *, hold: bool) -> None:
        self.fd = os.open(group_file(buffer), os.O_RDWR)
        self.index = index
        if hold:
            lock_byte(self.fd, gc.STATES + index)

    def plant(self, state: int, row: tuple, record_id: int) -> None:
        text = row[3].encode()
        start = gc.SLOT_BYTES * (self.index + 1)
        os.pwrite(self.fd, gc.RECORD.pack(len(text), zlib.crc32(text), *row[:3], record_id) + text, start)
        os.pwrite(self.fd, bytes([state]), gc.STATES + self.index)

    def state(self) -> int:
        return os.pread(self.fd, 1, gc.STATES + self.index)[0]

    def close(self) -> None:
        os.close(self.fd)


def log_once(buffer: Path) -> None:
    with walbuf.Writer(buffer, writer="next", run="r") as w:
        w.log({"y": 1})


def test_a_record_a_holder_committed_before_it_died_is_not_committed_again(tmp_path):
    buffer = new_buffer(tmp_path)
    record_id, *row = stored_row(buffer, "dead")  # the dead holder's transaction committed it
    slot = Slot(buffer, SLOT, hold=True)
    slot.plant(gc.TAKEN, tuple(row), record_id)
    log_once(buffer)
    assert slot.state() == gc.DONE  # what its waiting writer learns: committed
    assert records_of(buffer, "dead") == [(0, {"x": 0})]
    slot.close()


def test_a_record_a_holder_took_but_did_not_commit_before_it_died_is_committed_once(tmp_path):
    buffer = new_buffer(tmp_path)
    record_id, writer_id, _, _, _ = stored_row(buffer, "dead")
    slot = Slot(buffer, SLOT, hold=True)
    # Its transaction would have given the record the next id: it holds nothing.
    slot.plant(gc.TAKEN, (writer_id, 1, time.time(), json.dumps({"x": 1})), record_id + 1)
    log_once(buffer)
    assert slot.state() == gc.DONE
    assert records_of(buffer, "dead") == [(0, {"x": 0}), (1, {"x": 1})]
    slot.close()


def test_the_record_of_a_writer_that_died_waiting_for_the_turn_is_never_committed(tmp_path):
    buffer = new_buffer(tmp_path)
    _, writer_id, _, _, _ = stored_row(buffer, "dead")
    slot = Slot(buffer, SLOT, hold=False)  # no one holds the slot: its writer died
    slot.plant(gc.WAITING, (writer_id, 1, time.time(), json.dumps({"x": 1})), 0)
    log_once(buffer)
    # Its log() never returned, and the next process to open its writer id
    # would go on from step 0: a late commit would put two records at step 1.
    assert records_of(buffer, "dead") == [(0, {"x": 0})]
    assert records_of(buffer, "next") == [(0, {"y": 1})]
    slot.close()


INTERRUPTED_WRITER = """
import sys, walbuf
w = walbuf.Writer(sys.argv[1], writer="cut", run="r")
print("open", flush=True)
sys.stdin.readline()
try:
    w.log({"first": 1})
    print("logged", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.stdin.readline()  # still open, while another writer commits
print("step", w.log({"second": 2}), flush=True)
w.close()
"""


def has_line(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` printed something not read yet."""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        return bool(selector.select(0))


def line_of(proc: subprocess.Popen, within: float = 60) -> str:
    """The next line ``proc`` prints; fails (rather than hang) if none comes ``within`` seconds."""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        assert selector.select(within), f"no line from the writer in {within}s"
    return proc.stdout.readline()


@contextmanager
def writer_process(script: str, *args: str) -> Iterator[subprocess.Popen]:
    """A writer process running ``script`` (lines in and out), ended (killed if need be) afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def go_on(proc: subprocess.Popen) -> None:
    """Let ``proc`` past its next readline()."""
    proc.stdin.write("\n")
    proc.stdin.flush()


def waiting_in_slot(proc: subprocess.Popen, buffer: Path, logged_early: str) -> Slot:
    """Once ``proc``'s record waits in its slot (the lowest free one): that slot."""
    slot = Slot(buffer, 0, hold=False)
    while slot.state() != gc.WAITING:
        assert proc.poll() is None, "the writer ended before its record waited in its slot"
        assert not has_line(proc), logged_early
        os.sched_yield()
    return slot


def test_a_log_interrupted_while_it_waits_for_the_turn_writes_nothing_and_the_writer_goes_on(tmp_path):
    buffer = new_buffer(tmp_path)
    with writer_process(INTERRUPTED_WRITER, str(buffer)) as writer:
        assert line_of(writer) == "open\n"
        turn = take_turn(buffer)
        try:
            go_on(writer)
            waiting = waiting_in_slot(writer, buffer, "the writer logged without the turn")
            writer.send_signal(signal.SIGINT)
            give_turn(turn)
        finally:
            os.close(turn)
        assert line_of(writer) == "interrupted\n"
        waiting.close()
        log_once(buffer)  # takes the turn: the interrupted record must not go in with its commit
        go_on(writer)
        assert line_of(writer) == "step 0\n"
        assert writer.wait(timeout=60) == 0
    assert records_of(buffer, "cut") == [(0, {"second": 2})]


def test_a_forked_child_keeps_no_descriptor_of_the_group_file(tmp_path):
    buffer = new_buffer(tmp_path)
    with walbuf.Writer(buffer, writer="parent", run="r") as w:
        w.log({"a": 1})
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: which of its descriptors are the group file's
            try:
                fds = os.listdir("/proc/self/fd")
                held = [fd for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}") == str(group_file(buffer))]
                os.write(write, json.dumps(held).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as answer:
            held = json.loads(answer.read())
        os.waitpid(pid, 0)
        w.log({"a": 2})
    # Kept, a child's copy would keep the parent's locks (its slot, the turn
    # if the fork came while it was held) after the parent died.
    assert held == []
    assert [m for _, m in records_of(buffer, "parent")] == [{"a": 1}, {"a": 2}]


def test_a_group_file_of_another_layout_size_is_left_alone_and_writers_commit_their_own(tmp_path):
    buffer = tmp_path / "b.db"
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"a": 1})
    group_file(buffer).unlink()
    group_file(buffer).write_bytes(b"\0" * 100)
    group_file(buffer).chmod(0o600)
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"a": 2})
    assert group_file(buffer).read_bytes() == b"\0" * 100
    assert [m for _, m in records_of(buffer, "w")] == [{"a": 1}, {"a": 2}]


FSYNC_WRITER = """
import sys, walbuf
with walbuf.Writer(sys.argv[1], writer="careful", run="r", durability="fsync") as w:
    w.log({"a": 1})
"""


def test_a_writer_that_fsyncs_each_record_commits_its_own(tmp_path):
    buffer = new_buffer(tmp_path)
    turn = take_turn(buffer)  # held: a writer of the group would wait for it
    try:
        # Another's commit would not fsync its record: it must not wait for one.
        subprocess.run([sys.executable, "-c", FSYNC_WRITER, str(buffer)], check=True, timeout=60)
    finally:
        os.close(turn)
    assert records_of(buffer, "careful") == [(0, {"a": 1})]


LOCKED_OUT_WRITER = """
import sys, walbuf
w = walbuf.Writer(sys.argv[1], writer="late", run="r")
w.log({"a": 1})  # its keys' claim: a write transaction of its own
print("open", flush=True)
sys.stdin.readline()
print("step", w.log({"a": 2}), flush=True)
w.close()
"""


def test_a_writer_that_finds_sqlites_write_lock_taken_waits_in_its_slot_not_in_sqlites_sleeps(tmp_path):
    buffer = new_buffer(tmp_path)
    other = sqlite3.connect(buffer, isolation_level=None)  # a sync's transaction, say
    with writer_process(LOCKED_OUT_WRITER, str(buffer)) as writer, contextlib.closing(other):
        assert line_of(writer) == "open\n"
        other.execute("BEGIN IMMEDIATE")
        go_on(writer)
        # No one commits or waits in the group: the writer tries alone, and
        # finding the lock taken, its record waits in its slot, where the
        # next to find the lock free commits it (without the group's wait,
        # it would sleep in SQLite's, and others coming would wait behind it).
        waiting_in_slot(writer, buffer, "the writer logged while another held the write lock").close()
        other.execute("COMMIT")
        assert line_of(writer) == "step 1\n"
        assert writer.wait(timeout=60) == 0
    assert records_of(buffer, "late") == [(0, {"a": 1}), (1, {"a": 2})]


BUSY_WRITER = """
import sys, walbuf
with walbuf.Writer(sys.argv[1], writer=sys.argv[2], run="r") as w:
    for i in range(int(sys.argv[3])):
        w.log({"i": i, "text": "x" * 200})
    print("logged", flush=True)
    sys.stdin.readline()  # open, till the WAL was looked at: the last to close checkpoints it and removes it
"""


@pytest.mark.parametrize("writers", [1, 4])
def test_the_writers_commits_keep_the_wal_within_its_checkpoint_limit(tmp_path, writers):
    from walbuf.store.sqlite import PAGE_SIZE, WAL_AUTOCHECKPOINT

    buffer = new_buffer(tmp_path)
    frame = PAGE_SIZE + 24  # a WAL frame: its header and a page
    # Three times the limit's pages in all: without checkpoints the WAL would hold them.
    per_writer = 3 * WAL_AUTOCHECKPOINT // writers
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUSY_WRITER, str(buffer), f"w{i}", str(per_writer)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(writers)
    ]
    try:
        assert [line_of(p, within=600) for p in procs] == ["logged\n"] * writers
        # A checkpoint by hand is passive: it ends with the WAL whole when no
        # reader holds on to it, and the next commit starts the WAL over.
        wal = os.stat(f"{buffer}-wal").st_size
    finally:
        for p in procs:
            p.communicate("\n", timeout=60)
    assert [p.returncode for p in procs] == [0] * writers
    assert wal <= 2 * WAL_AUTOCHECKPOINT * frame
    assert sum(1 for r in walbuf.read(buffer) if r.writer.startswith("w")) == writers * per_writer


UNSLOTTED_WRITER = """
import sys, walbuf
w = walbuf.Writer(sys.argv[1], writer="late", run="r")
w.log({"a": "1"})
print("open", flush=True)
sys.stdin.readline()
print("logging", flush=True)
print("step", w.log({"a": sys.argv[2]}), flush=True)
w.close()
"""

SLEEPER = """
import ctypes
print("sleeping", flush=True)
ctypes.CDLL(None).usleep(600_000_000)
"""


def syscall_of(pid: int) -> str:
    """The system call ``pid`` waits in, by number ("running" if none)."""
    return Path(f"/proc/{pid}/syscall").read_text().split()[0]


def sleeping_syscall() -> str:
    """What /proc/PID/syscall shows of a process in libc's usleep(), where SQLite's busy wait sleeps."""
    with writer_process(SLEEPER) as sleeper:
        assert line_of(sleeper) == "sleeping\n"
        # After its line, the only wait it can be in is the sleep.
        while (stat := Path(f"/proc/{sleeper.pid}/stat").read_text())[stat.rindex(")") + 2] != "S":
            os.sched_yield()
        return syscall_of(sleeper.pid)


@pytest.mark.parametrize(
    ("slots_taken", "value"),
    [(gc.SLOTS, "2"), (0, "x" * (gc.ROOM + 1))],
    ids=["a writer beyond the slots", "a record too big for a slot"],
)
def test_what_no_slot_holds_waits_for_the_write_lock_as_without_a_group(tmp_path, slots_taken, value):
    buffer = new_buffer(tmp_path)
    sleeping = sleeping_syscall()
    others = [walbuf.Writer(buffer, writer=f"w{i}", run="r") for i in range(slots_taken)]
    for w in others:
        w.log({"x": 1})
    other = sqlite3.connect(buffer, isolation_level=None)  # a sync's transaction, say
    try:
        with writer_process(UNSLOTTED_WRITER, str(buffer), value) as writer:
            assert line_of(writer) == "open\n"
            other.execute("BEGIN IMMEDIATE")
            go_on(writer)
            assert line_of(writer) == "logging\n"
            while syscall_of(writer.pid) != sleeping:  # in SQLite's wait for the write lock
                assert writer.poll() is None, "the writer gave up on the write lock at once"
                os.sched_yield()
            other.execute("COMMIT")
            assert line_of(writer) == "step 1\n"
            assert writer.wait(timeout=60) == 0
    finally:
        other.close()
        for w in others:
            w.close()
    assert records_of(buffer, "late") == [(0, {"a": "1"}), (1, {"a": value})]
