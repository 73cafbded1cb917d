"""Crashes: kill -9 of writers and of the syncer at points hypothesis chooses; a read-only buffer.

Kill points are never reached by sleeping. A writer process (crash_writer.py)
prints each step once log() returned for it, and the test kills it with
SIGKILL when a chosen number of acknowledgements has arrived, while it keeps
writing more. A `walbuf sync` process is killed once it printed its plan,
while its rows are on their way to the fake W&B server (which then loses
them), or once the server received its rows, with the confirmation held back
or on its way. Each kill point is pinned by an @example, so every run
exercises it; hypothesis adds more. Where the kill landed is then read from
the evidence (the
buffer's log of syncs, what the server holds), and tallied: the tally is
printed (`pytest -rP`) and kept in pytest's cache
(`pytest --cache-show 'walbuf/*'`).

These tests are about a SQLite buffer: a file, its WAL and its lock files.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import selectors
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import as_reader, require_strace
from hypothesis import example, given, settings
from hypothesis import strategies as st
from wandb_server import FakeWandb

import walbuf

pytestmark = pytest.mark.slow  # real processes and syncs: not in the quick loop

TESTS = Path(__file__).parent
RUN = "crash"  # the run crash_writer.py logs to


def report(request: pytest.FixtureRequest, tally: Counter) -> None:
    """Print what a kill test exercised, and keep it in pytest's cache."""
    counts = dict(sorted(tally.items()))
    print(f"{request.node.name}: {json.dumps(counts, indent=1)}")
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    if cache is not None:
        cache.set(f"walbuf/crash-tally/{request.node.name}", counts)


# -- reading a buffer independently of walbuf's writer ------------------------------


def stored(buffer: Path, writer: str) -> list[walbuf.Record]:
    """The records of ``writer`` in run RUN, in the order logged (none if there is no buffer).

    A writer killed while it makes the buffer may leave the empty file it
    made (owner-only) before SQLite wrote anything: no buffer yet, either.
    """
    if not buffer.exists() or buffer.stat().st_size == 0:
        return []
    return list(walbuf.read(buffer, run=RUN, writer=writer))


def wal_frames(buffer: Path) -> int:
    """How many frames the buffer's WAL holds (0 without one): how far it grew before a kill."""
    wal = Path(f"{buffer}-wal")
    if not wal.exists():
        return 0
    with buffer.open("rb") as f:
        header = f.read(18)
    page = int.from_bytes(header[16:18], "big") if len(header) == 18 else 0
    page = {0: 1024, 1: 65536}.get(page, page)
    return max(0, (wal.stat().st_size - 32) // (page + 24))  # 32-byte header, 24 per frame


def integrity(buffer: Path) -> list[tuple[str, ...]]:
    """SQLite's own check of the file (and its WAL), with plain sqlite3."""
    with closing(sqlite3.connect(buffer)) as conn:
        return conn.execute("PRAGMA integrity_check").fetchall()


# -- writer processes that are killed at chosen points ---------------------------------


@dataclass
class Victim:
    """One crash_writer.py process, and what it said before it died."""

    writer: str
    kill_at: int  # killed once this many acknowledgements arrived (see kill_writers)
    proc: subprocess.Popen[bytes]
    opening: bool = False  # it printed "opening": it is in walbuf code now
    ready: int | None = None  # the last step it reported once its Writer was open
    acked: list[int] = field(default_factory=list)
    killed: bool = False
    _partial: bytes = b""

    def feed(self, chunk: bytes) -> int:
        """Take what the process printed; return how many acknowledgements it held."""
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        new = 0
        for line in lines:
            if line == b"opening":
                self.opening = True
            elif line.startswith(b"ready "):
                self.ready = int(line.split()[1])
            else:
                self.acked.append(int(line))
                new += 1
        return new


def kill_writers(buffer: Path, plan: list[tuple[str, int, int]], timeout: float = 120) -> list[Victim]:
    """Start one crash_writer.py per (writer id, kill_at, pad bytes); kill each with SIGKILL.

    The clock is the number of acknowledgements that arrived from all the
    processes together: a process is killed as soon as it is in walbuf code
    (it printed "opening") and that number reached its ``kill_at``, while it
    and the others go on writing. 0 kills it while it opens its Writer.
    Returns once every process is dead and all it printed has been read.
    """
    victims = [
        Victim(
            writer,
            kill_at,
            subprocess.Popen(
                [sys.executable, str(TESTS / "crash_writer.py"), str(buffer), writer, str(pad)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                bufsize=0,
            ),
        )
        for writer, kill_at, pad in plan
    ]
    selector = selectors.DefaultSelector()
    deadline = time.monotonic() + timeout
    try:
        for victim in victims:
            assert victim.proc.stdout is not None
            selector.register(victim.proc.stdout, selectors.EVENT_READ, victim)
        acknowledged = 0
        while selector.get_map():
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"writers did not reach their kill points in {timeout}s"
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    acknowledged += key.data.feed(chunk)
                else:
                    selector.unregister(key.fileobj)
            for victim in victims:
                if not victim.killed and victim.opening and acknowledged >= victim.kill_at:
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.killed = True
    finally:
        selector.close()
        for victim in victims:
            if victim.proc.poll() is None:
                victim.proc.kill()
            victim.proc.wait()
            assert victim.proc.stdout is not None and victim.proc.stderr is not None
            victim.proc.stdout.close()
            errors = victim.proc.stderr.read().decode(errors="replace")
            victim.proc.stderr.close()
            assert victim.proc.returncode == -signal.SIGKILL, (
                f"{victim.writer} died by itself ({victim.proc.returncode}): {errors}"
            )
    return victims


def check_survivor(buffer: Path, victim: Victim, before: int, tally: Counter) -> int:
    """The invariants of a writer killed by SIGKILL; ``before``: its records when it started.

    Every record the process acknowledged is in the buffer, in order, with
    its step; at most one more (logged, killed before it could say so); a
    reopened writer continued its steps. Returns its number of records now.
    """
    records = stored(buffer, victim.writer)
    steps = [r.step for r in records]
    assert steps == list(range(len(records))), f"{victim.writer}: steps not 0, 1, 2, ...: {steps[:20]}"
    assert [r.metrics["seq"] for r in records] == steps, f"{victim.writer}: a record at the wrong step"
    if victim.ready is None:  # killed while opening: it logged nothing
        assert victim.acked == [] and len(records) == before
        tally["kills"] += 1
        tally["kills while opening the Writer"] += 1
        return len(records)
    assert victim.ready == before - 1, f"{victim.writer} reopened at step {victim.ready}, not {before - 1}"
    assert victim.acked == list(range(before, before + len(victim.acked)))
    lost = len(set(victim.acked) - set(steps))
    tally["records acknowledged, then lost"] += lost
    assert lost == 0, f"{victim.writer}: {lost} acknowledged records lost"
    in_flight = len(records) - before - len(victim.acked)
    assert in_flight <= 1, f"{victim.writer}: {in_flight} records stored that log() never returned for"
    tally["kills"] += 1
    tally["records acknowledged"] += len(victim.acked)
    tally["records stored, killed before log() returned"] += in_flight
    return len(records)


def check_reopens_and_continues(buffer: Path, writer: str, count: int) -> None:
    with walbuf.Writer(buffer, writer=writer, run=RUN) as w:
        assert w.log({"seq": count, "pad": ""}) == count


# (kill_at: acknowledgements before the kill, pad: bytes of padding per record).
# A pad past the 1 KiB page size puts each record on overflow pages, so a
# commit is several WAL frames; long lives with large records pass the
# WAL's autocheckpoint (walbuf sets it at 10,000 pages).
kill_at = st.integers(min_value=0, max_value=3000)
pad = st.integers(min_value=0, max_value=8000)


def test_writer_killed_at_any_point_keeps_every_acknowledged_record_in_order_and_reopens(tmp_path_factory, request):
    """A writer id killed, reopened, killed again...: each time every acknowledged record is there.

    Each life logs records of a chosen size and is killed after a chosen
    number of acknowledgements, 0 meaning while it opens its Writer.
    """

    @settings(max_examples=20, deadline=None)
    @given(lives=st.lists(st.tuples(kill_at, pad), min_size=1, max_size=3))
    # Always: killed while opening, after one record, and past an autocheckpoint.
    @example(lives=[(0, 0), (1, 0), (3000, 8000)])
    def lives_of_one_writer(lives):
        buffer = tmp_path_factory.mktemp("writer-kill") / "b.db"
        count = 0
        for at, size in lives:
            (victim,) = kill_writers(buffer, [("victim", at, size)])
            frames = wal_frames(buffer)
            tally["largest WAL at a kill, in frames"] = max(tally["largest WAL at a kill, in frames"], frames)
            tally["kills after the WAL passed 10,000 frames"] += frames >= 10_000
            count = check_survivor(buffer, victim, before=count, tally=tally)
            if buffer.exists():
                assert integrity(buffer) == [("ok",)]
        check_reopens_and_continues(buffer, "victim", count)
        assert integrity(buffer) == [("ok",)]

    tally: Counter = Counter()
    lives_of_one_writer()
    report(request, tally)


def test_concurrent_writers_killed_at_different_points_keep_every_acknowledged_record_in_order(
    tmp_path_factory, request
):
    """2-3 processes write one buffer at once; each is killed at its own point, the others write on.

    A writer may have records from an earlier life (then the buffer exists;
    else the processes create it together, and may be killed while they do).
    """

    @settings(max_examples=15, deadline=None)
    @given(writers=st.lists(st.tuples(st.integers(min_value=0, max_value=30), kill_at, pad), min_size=2, max_size=3))
    # Always: a new buffer the processes create together, one killed while it does.
    @example(writers=[(0, 0, 0), (0, 200, 100), (0, 400, 2000)])
    def concurrent_writers(writers):
        buffer = tmp_path_factory.mktemp("writers-kill") / "b.db"
        names = [f"w{i}" for i in range(len(writers))]
        for name, (earlier, _, _) in zip(names, writers, strict=False):
            if earlier:
                with walbuf.Writer(buffer, writer=name, run=RUN) as w:
                    for i in range(earlier):
                        w.log({"seq": i, "pad": ""})
        victims = kill_writers(buffer, [(name, at, size) for name, (_, at, size) in zip(names, writers, strict=False)])
        counts = {
            v.writer: check_survivor(buffer, v, before=earlier, tally=tally)
            for v, (earlier, _, _) in zip(victims, writers, strict=False)
        }
        if buffer.exists():
            assert integrity(buffer) == [("ok",)]
        for name, count in counts.items():
            check_reopens_and_continues(buffer, name, count)
        assert integrity(buffer) == [("ok",)]

    tally: Counter = Counter()
    concurrent_writers()
    report(request, tally)


# -- the syncer killed at chosen points ---------------------------------------------


# Where a `walbuf sync` process is killed. wandb-core (0.31) sends a run's
# history rows in one request, with the completion, when the run finishes:
# "after N of the rows" is no finer than "after the rows".
SYNC_KILL_POINTS = {
    "planned": "it printed what it will send: its upload is logged as running, W&B has nothing yet",
    "in flight": "its rows are on their way to W&B, and never land (LossyWandb)",
    "held": "W&B received every row and the completion, and never answers (hold_uploads)",
    "confirming": "the instant W&B received every row and the completion, its answer on the way",
}


class LossyWandb(FakeWandb):
    """The fake W&B server, which can also lose the history posts in flight when a syncer dies.

    After ``stall_history()``, a post that carries history rows is neither
    stored nor answered; ``lose_stalled()`` drops the posts stalled so far
    (their sender is dead: they never land) and stores later ones as usual.
    """

    def __init__(self) -> None:
        super().__init__()
        self._stalling = False
        self._stalled = 0
        self._arrived = threading.Condition()
        self._lost = threading.Event()

    def stall_history(self) -> None:
        with self._arrived:
            self._stalled = 0
        self._lost.clear()
        self._stalling = True

    def wait_for_stalled_post(self, timeout: float) -> None:
        with self._arrived:
            if not self._arrived.wait_for(lambda: self._stalled > 0, timeout):
                raise TimeoutError(f"no history post arrived within {timeout}s")

    def lose_stalled(self) -> None:
        self._stalling = False
        self._lost.set()

    def file_stream(self, *args: Any, **kwargs: Any) -> str | None:
        body = kwargs["body"] if "body" in kwargs else args[-1]
        if self._stalling and "wandb-history.jsonl" in (body.get("files") or {}):
            with self._arrived:
                self._stalled += 1
                self._arrived.notify_all()
            self._lost.wait()
            return None
        return super().file_stream(*args, **kwargs)

    def stop(self) -> None:
        self._lost.set()
        super().stop()


def sync_command(buffer: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "walbuf", "sync", str(buffer), "--project", "crash", *args]


def sync_env(server: FakeWandb, buffer: Path) -> dict[str, str]:
    """The environment test_sync.py gives a syncer, with wandb's files beside the buffer."""
    return {**os.environ, **server.env(), "WANDB_DIR": str(buffer.parent)}


def rows_at(server: FakeWandb) -> int:
    return sum(len(run.history) for run in list(server.runs.values()))


def newest_sync(buffer: Path) -> tuple[int, str] | None:
    """(id, status) of the buffer's newest sync log entry, read with plain sqlite3."""
    with closing(sqlite3.connect(f"file:{buffer}?mode=ro", uri=True)) as conn:
        return conn.execute("SELECT id, status FROM syncs ORDER BY id DESC LIMIT 1").fetchone()


def pending(buffer: Path) -> dict[str, int]:
    return {w.writer: w.pending for run in walbuf.status(buffer).runs for w in run.writers}


def kill_syncer(server: LossyWandb, buffer: Path, point: str) -> str:
    """Run `walbuf sync`, kill it with SIGKILL at ``point``; say where the kill landed."""
    assert point in SYNC_KILL_POINTS
    base, to_send = rows_at(server), sum(pending(buffer).values())
    before = newest_sync(buffer)
    if point == "held":
        server.hold_uploads()
    if point == "in flight":
        server.stall_history()
    proc = subprocess.Popen(
        sync_command(buffer),
        env=sync_env(server, buffer),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        if point == "planned":
            for line in proc.stderr:  # "RUN -> TARGET: sending N records (...)"
                if ": sending " in line:
                    break
        elif point == "in flight":
            server.wait_for_stalled_post(timeout=90)
        else:
            server.wait_for_rows(base + (to_send if point == "confirming" else 1), timeout=90)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # Its wandb-core outlives it for a moment: let it die before W&B answers
        # what it sent, and before the next syncer, whose posts it must not mix with.
        wait_gone(wandb_core_of(proc.pid), timeout=60)
        server.release_uploads()
        server.lose_stalled()
        assert proc.stderr is not None
        proc.stderr.close()
    assert proc.returncode in (0, -signal.SIGKILL), f"the syncer failed by itself: {proc.returncode}"
    after = newest_sync(buffer)
    if proc.returncode == 0:
        return "it had finished"
    if after == before:
        return "before it logged its upload"
    if after is not None and after[1] == "running":
        if rows_at(server) > base:
            return "upload logged as running, W&B had the rows, unconfirmed"
        return "upload logged as running, W&B had no row"
    return f"after its upload was logged as {after[1] if after else None!r}"


def wandb_core_of(pid: int) -> list[int]:
    """The wandb-core processes a syncer started (they name it: ``--pid PID``), alive or not."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone, or not ours to read
            if argv and argv[0].endswith(b"wandb-core") and b"--pid" in argv:
                if argv[argv.index(b"--pid") + 1 :][:1] == [str(pid).encode()]:
                    found.append(int(entry.name))
    return found


def wait_gone(pids: list[int], timeout: float) -> None:
    """Block until these processes exited (a pidfd turns readable at exit); SIGKILL them after ``timeout``."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            if not select.select([fd], [], [], timeout)[0]:
                os.kill(pid, signal.SIGKILL)
                select.select([fd], [], [], timeout)
        finally:
            os.close(fd)


def first_arrivals(server: FakeWandb, wandb_id: str, writer: str) -> tuple[list[tuple[int, int]], int]:
    """(step, seq) of ``writer``'s rows in the order they first arrived; and the number of repeats."""
    seen: set[tuple[int, int]] = set()
    first: list[tuple[int, int]] = []
    repeats = 0
    for row in server.run(wandb_id).history:
        if f"{writer}/step" not in row:
            continue
        key = (row[f"{writer}/step"], row[f"{writer}/seq"])
        if key in seen:
            repeats += 1
        else:
            seen.add(key)
            first.append(key)
    return first, repeats


def log_records(buffer: Path, writer: str, n: int) -> None:
    with walbuf.Writer(buffer, writer=writer, run=RUN) as w:
        start = 0 if w.last_step is None else w.last_step + 1
        for seq in range(start, start + n):
            w.log({"seq": seq})


def test_syncer_killed_at_any_point_then_a_normal_sync_delivers_every_record_in_order(tmp_path_factory, request):
    """Syncs killed at chosen points, writers appending after each, then one normal sync.

    Every record reaches W&B at least once; per writer, with repeats
    removed, W&B holds exactly the buffer's records in their order; nothing
    is left pending.
    """

    @settings(max_examples=12, deadline=None)
    @given(
        records=st.lists(st.integers(min_value=1, max_value=60), min_size=1, max_size=3),
        kills=st.lists(st.sampled_from(sorted(SYNC_KILL_POINTS)), min_size=1, max_size=2),
        appended=st.integers(min_value=1, max_value=5),
    )
    # Always: each kill point at least once.
    @example(records=[3, 2], kills=["planned"], appended=1)
    @example(records=[3, 2], kills=["in flight"], appended=1)
    @example(records=[3, 2], kills=["held"], appended=1)
    @example(records=[3, 2], kills=["confirming"], appended=1)
    def killed_syncs(records, kills, appended):
        buffer = tmp_path_factory.mktemp("syncer-kill") / "b.db"
        writers = [f"rank-{i}" for i in range(len(records))]
        for writer, n in zip(writers, records, strict=False):
            log_records(buffer, writer, n)
        with LossyWandb() as server:
            for point in kills:
                landed = kill_syncer(server, buffer, point)
                tally[f"killed {point}: {landed}"] += 1
                tally["kills"] += 1
                for writer in writers:
                    log_records(buffer, writer, appended)
            final = subprocess.run(
                sync_command(buffer, "--quiet"),
                env=sync_env(server, buffer),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert final.returncode == 0, final.stderr
            assert all(n == 0 for n in pending(buffer).values()), pending(buffer)
            (run,) = walbuf.status(buffer).runs
            for writer in writers:
                logged = [(r.step, r.metrics["seq"]) for r in stored(buffer, writer)]
                arrived, repeats = first_arrivals(server, run.wandb_id, writer)
                lost = len(set(logged) - set(arrived))
                tally["records"] += len(logged)
                tally["lost"] += lost
                tally["rows received more than once"] += repeats
                assert lost == 0, f"{writer}: {lost} records never reached W&B"
                assert arrived == logged, f"{writer}: W&B's rows, repeats removed, are not its records in order"

    tally: Counter = Counter()
    killed_syncs()
    report(request, tally)


# -- a buffer the process may read but not write ------------------------------------------


def run_as_reader(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(as_reader([sys.executable, *args]), capture_output=True, text=True, timeout=60)


def snapshot(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``directory``: its mode and the digest of its bytes."""
    return {
        str(p.relative_to(directory)): (p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def set_writable(directory: Path, writable: bool) -> None:
    for p in [directory, *directory.rglob("*")]:
        mode = p.stat().st_mode
        write = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
        p.chmod(mode | stat.S_IWUSR if writable else mode & ~write)


@dataclass
class ReadOnlyBuffer:
    path: Path
    records: list[dict]  # what `walbuf records` prints, as its owner read it
    status: dict  # what `walbuf status --json` prints, as its owner read it


READ_ONLY_STATES = {
    "closed": "every writer closed: SQLite removed the -wal and -shm files",
    "open elsewhere": "a writer with write access still has it open: -wal and -shm exist",
}


@contextmanager
def read_only_buffer(tmp_path: Path, state: str):
    """A buffer with records, in ``state``, whose directory and files are a-w."""
    assert state in READ_ONLY_STATES
    directory = tmp_path / "readonly"
    buffer = directory / "exp.db"
    with walbuf.Writer(buffer, writer="trainer", run="exp1") as w:
        for i in range(3):
            w.log({"loss": 1.0 / (i + 1)})
    live = walbuf.Writer(buffer, writer="eval", run="exp1") if state == "open elsewhere" else None
    try:
        if live is not None:
            live.log({"acc": 0.5})
        records = [
            {"run": r.run, "writer": r.writer, "step": r.step, "time": r.time, "metrics": r.metrics}
            for r in walbuf.read(buffer)
        ]
        status = walbuf.status(buffer).to_dict()
        assert Path(f"{buffer}-wal").exists() == (live is not None), "the state is not what it says"
        set_writable(directory, False)
        try:
            yield ReadOnlyBuffer(buffer, records, status)
        finally:
            set_writable(directory, True)
    finally:
        if live is not None:
            live.close()


def test_the_reader_process_cannot_write_in_the_buffers_directory(tmp_path):
    """The premise of the tests below: as_reader really takes write access away."""
    with read_only_buffer(tmp_path, "closed") as ro:
        probe = ro.path.parent / "probe"
        proc = run_as_reader("-c", f"open({str(probe)!r}, 'x')")
        assert proc.returncode == 1 and "PermissionError" in proc.stderr
        assert not probe.exists()


@pytest.mark.parametrize("state", ["closed", "open elsewhere"])
def test_records_of_a_buffer_the_user_may_only_read_are_printed(tmp_path, state):
    with read_only_buffer(tmp_path, state) as ro:
        proc = run_as_reader("-m", "walbuf", "records", str(ro.path))
        assert "Traceback" not in proc.stderr
        assert (proc.returncode, proc.stderr) == (0, "")
        assert [json.loads(line) for line in proc.stdout.splitlines()] == ro.records


@pytest.mark.parametrize("state", ["closed", "open elsewhere"])
def test_status_of_a_buffer_the_user_may_only_read_is_shown(tmp_path, state):
    with read_only_buffer(tmp_path, state) as ro:
        proc = run_as_reader("-m", "walbuf", "status", str(ro.path), "--json")
        assert "Traceback" not in proc.stderr
        assert (proc.returncode, proc.stderr) == (0, "")
        assert json.loads(proc.stdout) == ro.status


@pytest.mark.parametrize("state", sorted(READ_ONLY_STATES))
def test_reading_a_buffer_the_user_may_only_read_changes_no_file(tmp_path, state):
    with read_only_buffer(tmp_path, state) as ro:
        before = snapshot(ro.path.parent)
        for command in ("records", "status"):
            proc = run_as_reader("-m", "walbuf", command, str(ro.path))
            assert proc.returncode == 0, proc.stderr  # it read the buffer: no change for want of reading it
        assert snapshot(ro.path.parent) == before


@pytest.mark.parametrize("state", sorted(READ_ONLY_STATES))
@pytest.mark.parametrize("writer", ["trainer", "new"])
def test_a_writer_on_a_buffer_the_user_may_only_read_raises_a_walbuf_error_saying_so(tmp_path, state, writer):
    with read_only_buffer(tmp_path, state) as ro:
        proc = run_as_reader(str(TESTS / "open_writer.py"), str(ro.path), writer, "exp1")
        assert proc.returncode == 0, proc.stderr
        outcome = json.loads(proc.stdout)
        assert outcome["raised"] is not None, "it logged into a buffer it may not write"
        assert outcome["walbuf_error"], f"{outcome['raised']} is not a walbuf.WalbufError: {outcome['message']}"
        assert "not writable" in outcome["message"], outcome["message"]


@pytest.mark.parametrize("state", sorted(READ_ONLY_STATES))
def test_a_writer_on_a_buffer_the_user_may_only_read_changes_no_file(tmp_path, state):
    with read_only_buffer(tmp_path, state) as ro:
        before = snapshot(ro.path.parent)
        proc = run_as_reader(str(TESTS / "open_writer.py"), str(ro.path), "trainer", "exp1")
        assert json.loads(proc.stdout)["raised"] is not None
        assert snapshot(ro.path.parent) == before


@pytest.mark.parametrize("state", sorted(READ_ONLY_STATES))
def test_prune_of_a_buffer_the_user_may_only_read_exits_77_in_one_line(tmp_path, state):
    with read_only_buffer(tmp_path, state) as ro:
        before = snapshot(ro.path.parent)
        proc = run_as_reader("-m", "walbuf", "prune", str(ro.path), "--older-than", "0s")
        assert proc.returncode == 77, proc.stderr
        assert proc.stderr.count("\n") == 1 and "not writable" in proc.stderr
        assert snapshot(ro.path.parent) == before


@pytest.mark.parametrize("state", sorted(READ_ONLY_STATES))
def test_doctor_examines_a_buffer_the_user_may_only_read(tmp_path, state):
    with read_only_buffer(tmp_path, state) as ro:
        proc = run_as_reader("-m", "walbuf", "doctor", str(ro.path))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "integrity: ok" in proc.stdout


MAKE = "import sys, walbuf; walbuf.Writer(sys.argv[1], writer='w', run='exp').log({'i': 0})"


def test_a_sqlite_buffer_whose_maker_was_killed_at_any_sync_of_its_journal_is_made_whole_by_the_next_writer(tmp_path):
    # The first writer of a new file sets its page size and WAL mode and makes
    # the schema; killed as it syncs the journal of any of those transactions
    # (each a point of a clean run), it leaves the file's first pages and a
    # journal. The next writer makes the buffer as if the file were new: in
    # WAL mode (a file left in rollback-journal mode once stayed so for good).
    strace = require_strace()
    clean = tmp_path / "clean"
    clean.mkdir()
    trace = tmp_path / "trace"
    journal = ["-P", str(clean / "B.db-journal"), "-e", "trace=fdatasync,fsync"]
    made = subprocess.run([strace, "-f", "-qq", "-o", str(trace), *journal, sys.executable, "-c", MAKE, clean / "B.db"])
    assert made.returncode == 0
    syncs = sum(1 for line in trace.read_text().splitlines() if "sync(" in line)
    assert syncs > 0
    for when in range(1, syncs + 1):
        folder = tmp_path / f"kill-{when}"
        folder.mkdir()
        buffer = folder / "B.db"
        inject = ["-P", str(folder / "B.db-journal"), "-e", "trace=fdatasync,fsync"]
        inject += ["-e", f"inject=fdatasync,fsync:signal=SIGKILL:when={when}"]
        killed = subprocess.run([strace, "-f", "-qq", "-o", os.devnull, *inject, sys.executable, "-c", MAKE, buffer])
        assert killed.returncode == -signal.SIGKILL
        with walbuf.Writer(buffer, writer="w", run="exp") as w:
            w.log({"i": 1})
        assert [r.metrics["i"] for r in walbuf.read(buffer)] == [1]
        report = walbuf.doctor(buffer)
        assert report.healthy, [f for f in report.findings if not f.ok]
