"""Crash points, enumerated (issue 51): a writer and a syncer killed as they enter the Nth call of a file syscall.

Kills at random moments (test_crashes.py) land where a process spends its
time; a defect that sits between two syscalls is hit by chance only. Here
strace(1) kills from outside, at each call in turn:

    strace -f -e trace=SYSCALL -e inject=SYSCALL:signal=SIGKILL:when=N ACTOR

for each SYSCALL of SYSCALLS, each buffer kind (a SQLite file, a directory
buffer) and each actor: a writer process (crash_point_writer.py: a few
hundred records of two writers over three lives, a config, summaries,
flushes and closes; in a directory buffer each life seals its shard and the
next starts one), and `walbuf sync` of a buffer filled beforehand (records
synced before and not, several writers, one that died and one that stays
open: in a directory buffer sealed, ingested and live shards), syncing into
the fake W&B server through the real wandb SDK.

How strace counts, and so what N is (strace 6.1, checked here):

- A tracee is a thread: with -f every thread of every process the actor
  starts (wandb-core's among them) counts its own calls of SYSCALL from 1.
  The first thread to enter its Nth call is killed with SIGKILL (its whole
  process dies) as it enters it: the call is not made. A thread of another
  process that later enters its own Nth call is killed too (wandb-core
  after walbuf sync died, or walbuf sync after wandb-core did).
- The injected syscall must be traced: with ``-e trace=none`` strace
  injects nothing. Its trace goes to a file (-o), never between the
  actor's lines; -Y and -y there name each thread's program and each
  call's file, which is how a kill is told: the threads killed as they
  entered their Nth call.

So a clean run under strace first counts each thread's calls of each
syscall, and N ranges over 1 to the largest count (a smaller count is some
thread's last call of that syscall). A point may find no thread reaching N
(threads of wandb-core share their calls differently from run to run): the
actor then runs to its end, and is checked as any other.

After each kill: every record the writer acknowledged (its line printed
once log() returned) is in the buffer exactly once, at its step, with at
most one more that was being logged; the writers open again and continue
their steps; `status` and `doctor` say nothing is damaged; a `walbuf sync`
process exits 0, after which nothing is pending and the fake server holds
every record (and the acknowledged config and summary), duplicates
counted, not failed on: delivery is at-least-once. A syncer that survived
its wandb-core's death must have failed cleanly (no traceback) and
marked nothing synced.

By default each syscall is killed at POINTS calls spread evenly over its
count, its last call among them; ``WALBUF_CRASH_POINTS=all`` kills at every
call (the full sweep), ``WALBUF_CRASH_POINTS=K`` at K, and
``WALBUF_CRASH_AT=N[,N...]`` at those calls only (to see a point again:
where threads share the calls differently, or another process commits
the writer's records, it may land elsewhere). Each test prints
its tally (`pytest -rP`) and keeps it in pytest's cache; the module prints
the table of all it ran at its end (docs/testing.md, "Crash points").
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import rows_of
from crash_point_check import examine
from wandb_server import FakeWandb

from walbuf.directory.host import silent_after

pytestmark = pytest.mark.slow  # hundreds of real processes under strace, and syncs

TESTS = Path(__file__).parent
STRACE = shutil.which("strace")
SYSCALLS = ("write", "pwrite64", "fdatasync", "fsync", "rename", "ftruncate", "unlink", "unlinkat")
KINDS = {"sqlite": "B.db", "directory": "B/"}
ACTORS = ("writer", "syncer")
RUN = "crash"  # crash_point_writer.py's run
POINTS = 2  # crash points per syscall by default (WALBUF_CRASH_POINTS: a number, or "all")
# A failure guard, never a way to wait: a process still running after this
# long is killed and the point fails, saying what it printed.
TIMEOUT = 300.0
# The writer actor: LIVES lives of RECORDS records of "train" (and one of "eval" every tenth).
LIVES, RECORDS = 3, 60
# A damaged buffer, in what doctor says (its other findings are expected after a kill: a dead writer's shard not yet
# taken in, a sync that died).
DAMAGE_CHECKS = ("integrity", "schema", "trust", "contents")
DAMAGE_WORDS = ("damaged", "not read past", "does not end", "set aside", "cannot be read", "malformed")
CUT_OFF = "holds the journal of a transaction under way or cut off"  # walbuf's words for a hot journal of the hub
UNMADE = "it is an empty database"  # walbuf's words for a SQLite buffer whose maker was killed before its first commit


def strace_works() -> str | None:
    """Why strace cannot kill here (None if it can): missing, or not allowed to trace (a container without ptrace)."""
    if STRACE is None:
        return "strace is missing: apt-get install strace"
    probe = subprocess.run(
        [STRACE, "-f", "-o", "/dev/null", *expressions("write", 1), "sh", "-c", "echo unkilled"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode == -signal.SIGKILL and probe.stdout == "":  # killed as it entered its first write
        return None
    return f"strace cannot kill at a call here ({probe.returncode}): {probe.stdout} {probe.stderr.strip()}"


def expressions(syscall: str | None, when: int) -> list[str]:
    """strace's -e arguments: trace SYSCALLS (or ``syscall``), and kill at the ``when``-th call of ``syscall``.

    "?" lets a name this architecture lacks (unlink and rename on arm64) count no call rather than stop strace.
    """
    names = ",".join(f"?{name}" for name in (SYSCALLS if syscall is None else (syscall,)))
    return ["-e", f"trace={names}", *(["-e", f"inject={names}:signal=SIGKILL:when={when}"] if when else [])]


def points_wanted() -> str:
    wanted = os.environ.get("WALBUF_CRASH_POINTS", str(POINTS))
    if wanted != "all" and not (wanted.isdigit() and int(wanted) >= 1):
        raise pytest.UsageError(f"WALBUF_CRASH_POINTS is {wanted!r}: give a number of points per syscall, or all")
    return wanted


def chosen() -> list[int]:
    """WALBUF_CRASH_AT=N[,N...]: kill at exactly these calls (to see one point again), else none chosen."""
    wanted = os.environ.get("WALBUF_CRASH_AT", "")
    if wanted and not all(n.isdigit() and int(n) >= 1 for n in wanted.split(",")):
        raise pytest.UsageError(f"WALBUF_CRASH_AT is {wanted!r}: give calls to kill at, N[,N...]")
    return sorted({int(n) for n in wanted.split(",")}) if wanted else []


def jobs() -> int:
    """How many points run at once (WALBUF_CRASH_JOBS, default two per core; see Harness)."""
    return int(os.environ.get("WALBUF_CRASH_JOBS") or 2 * (os.cpu_count() or 1))


def spread(calls: int, wanted: str) -> list[int]:
    """The N to kill at, of 1..calls: all of them, or ``wanted`` spread evenly, the last among them."""
    if wanted == "all":
        return list(range(1, calls + 1))
    return sorted({max(1, round(i * calls / int(wanted))) for i in range(1, int(wanted) + 1)}) if calls > 0 else []


# -- running a process under strace, bounded ----------------------------------------------


CALL = re.compile(r"(\d+)<(.*?)> (\w+)\(")
KILLED = re.compile(r"(\d+)<(.*?)> \+\+\+ killed by SIGKILL")


@dataclass
class Ran:
    """A process's end: its exit code (negative: the signal that killed it; None: it hung and was killed), output."""

    returncode: int | None
    stdout: str
    stderr: str

    @property
    def hung(self) -> bool:
        return self.returncode is None

    def said(self) -> str:
        return f"stdout: {self.stdout[-1500:]!r}\nstderr: {self.stderr[-3000:]!r}"


def run_bounded(
    argv: list[str], env: dict[str, str], timeout: float = TIMEOUT, on_line: Callable[[str], None] | None = None
) -> Ran:
    """Run ``argv`` to its end (and every process it started that holds its stdout), in a process group of its own,
    handing each line it prints to ``on_line`` as it comes; past ``timeout`` the group is killed, and the run says it
    hung."""
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors, env=env, start_new_session=True
        )
        assert proc.stdout is not None
        out, partial, hung = b"", b"", False
        with proc.stdout, selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    hung = True
                    break
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                out += chunk
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    if on_line is not None:
                        on_line(line.decode(errors="replace"))
        if not hung:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
        if hung:
            kill_group(proc.pid)
            proc.wait()
        errors.seek(0)
        err = errors.read().decode(errors="replace")
    return Ran(None if hung else proc.returncode, out.decode(errors="replace"), err)


def kill_group(pgid: int) -> None:
    """SIGKILL the process group this test started (by its id)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # every process of it has ended


@dataclass(frozen=True)
class Hit:
    """A thread strace killed as it entered its Nth call: its program, and the call (with its file)."""

    program: str
    call: str

    @property
    def where(self) -> str:
        """The program, the syscall and the name of the file it was entering on: "python pwrite64(B.db-wal)"."""
        name, _, args = self.call.partition("(")
        found = re.match(r'\d+<([^>]*)>(?:, "([^"]*)")?|AT_FDCWD<[^>]*>, "([^"]*)"|"([^"]*)"', args)
        path = next((g for g in (found.groups() if found else ()) if g is not None), "?")
        if name == "unlinkat" and found and found[2] is not None:
            path = found[2]  # the name in the folder the descriptor is
        base = re.sub(r":\[\d+\]$", "", path.rstrip("/").rpartition("/")[2] or path)  # pipe:[123] -> pipe
        # Random names: wandb's run folders, tempfile's, and writer ids' lock files.
        base = re.sub(r"^(run-\d+_\d+-)\w+$|^(tmp)[a-z0-9_]{8}|^(writer-)[0-9a-f]{24}(?=\.lock$)", r"\1\2\3ID", base)
        return f"{self.program} {name}({re.sub(r'[0-9]{4,}', 'N', base)})"


@dataclass
class Traced:
    ran: Ran
    counts: dict[str, dict[str, int]]  # syscall -> program -> the most calls one of its threads made
    hits: list[Hit]  # the threads killed as they entered their Nth call, in the order strace told it


def under_strace(
    command: list[str],
    env: dict[str, str],
    trace: Path,
    syscall: str | None,
    when: int,
    on_line: Callable[[str], None] | None = None,
) -> Traced:
    """Run ``command`` under strace -f: counting each thread's calls of SYSCALLS (``when`` 0), or killing each
    thread as it enters its ``when``-th call of ``syscall``. ``on_line``: as run_bounded's."""
    argv = [STRACE or "strace", "-f", "-Y", "-y", "-o", str(trace), *expressions(syscall, when)]
    ran = run_bounded([*argv, *command], env, on_line=on_line)
    per_thread: dict[tuple[str, int], tuple[str, int]] = {}  # (syscall, tid) -> (program, calls)
    last: dict[int, str] = {}
    killed: list[tuple[int, str]] = []
    for line in trace.read_text(errors="replace").splitlines():
        if m := CALL.match(line):
            tid, program, name = int(m[1]), m[2], m[3]
            calls = per_thread.get((name, tid), (program, 0))[1] + 1
            per_thread[(name, tid)] = (program, calls)
            last[tid] = line
        elif m := KILLED.match(line):
            killed.append((int(m[1]), m[2]))
    counts: dict[str, dict[str, int]] = defaultdict(dict)
    for (name, _), (program, calls) in per_thread.items():
        counts[name][program] = max(counts[name].get(program, 0), calls)
    hits = []
    if when:
        for tid, program in killed:
            if per_thread.get((syscall or "", tid), ("", 0))[1] == when:
                hits.append(Hit(program, last[tid].split(" ", 1)[1][:160]))
    return Traced(ran, dict(counts), hits)


# -- what a buffer holds after a kill ---------------------------------------------------------------


@dataclass
class Look:
    """What crash_point_check.py read of a buffer (see there)."""

    exists: bool
    records: dict[str, list[tuple[int, Any]]]  # "RUN/WRITER" -> (step, seq), in order
    status: dict[str, Any] | None
    doctor: list[tuple[str, bool, str]]
    errors: dict[str, str]
    reopened: dict[str, int] | None


def look(buffer: str, env: dict[str, str], reopen: tuple[str, ...] = ()) -> tuple[Look | None, Ran]:
    """Read ``buffer`` in a process of its own (None if that process failed or hung), then open ``reopen``'s writers
    again and log one record each."""
    ran = run_bounded([sys.executable, str(TESTS / "crash_point_check.py"), buffer, *reopen], env)
    lines = ran.stdout.splitlines()
    if not lines:
        return None, ran
    return seen_as(json.loads(lines[0]), json.loads(lines[1]) if len(lines) > 1 else None), ran


def look_here(buffer: str) -> Look:
    """Read ``buffer`` in this process: where no process runs on it any more (reading then waits for nothing)."""
    return seen_as(examine(buffer), None)


def seen_as(found: dict[str, Any], reopened: dict[str, int] | None) -> Look:
    return Look(
        exists=found["exists"],
        records={k: [(s, q) for s, q in v] for k, v in (found["records"] or {}).items()},
        status=found["status"],
        doctor=[(c, ok, d) for c, ok, d in found["doctor"] or []],
        errors=found["errors"],
        reopened=reopened,
    )


def damage(seen: Look) -> list[str]:
    """What says the buffer is damaged: what could not be read, a shard refused or set aside, doctor's findings.

    Not a transaction a killed sync cut off in a directory buffer's hub:
    readers never roll one back (another host's sync may be under way),
    they say so and read nothing, and the next sync rolls it back. Nor a
    SQLite buffer whose maker was killed before it committed the schema:
    it holds no record, readers say there is no buffer, and the next writer
    makes it.
    """
    said = [f"{what} raised {e}" for what, e in seen.errors.items() if CUT_OFF not in e and UNMADE not in e]
    if seen.status is not None:
        said += [f"status: shard set aside: {s}" for s in seen.status.get("damaged_shards", [])]
        said += [f"status: shard {s['shard']} refused: {s['refused']}" for s in seen.status["shards"] if s["refused"]]
    for check, ok, detail in seen.doctor:
        if ok or CUT_OFF in detail:
            continue
        if check in DAMAGE_CHECKS or any(word in detail for word in DAMAGE_WORDS):
            said.append(f"doctor: {check}: {detail}")
    return said


def found_damage(point: Point, seen: Look, when: str) -> None:
    said = damage(seen)
    point.tally["points that found damage"] = max(point.tally["points that found damage"], int(bool(said)))
    for what in said:
        point.fail(f"{when}: {what}")


def cut_off(seen: Look) -> bool:
    """Whether reading met the journal of a transaction a killed sync cut off (see damage)."""
    return any(CUT_OFF in error for error in seen.errors.values())


def pending(seen: Look) -> int:
    assert seen.status is not None
    return sum(run["pending"] for run in seen.status["runs"])


def check_records(point: Point, seen: Look, when: str, kept: set[tuple[str, int]]) -> None:
    """Each writer's records are steps 0, 1, 2, ... each once, each holding its own step as seq; those of ``kept``
    ((writer, step): acknowledged, or in the buffer before) among them."""
    for writer, records in seen.records.items():
        steps = [step for step, _ in records]
        if steps != list(range(len(steps))):
            twice = sorted(s for s, n in Counter(steps).items() if n > 1)
            gaps = sorted(set(range(max(steps) + 1)) - set(steps)) if steps else []
            point.tally["records twice in the buffer"] += len(twice)
            point.fail(f"{when}: {writer}: steps not 0, 1, 2, ...: twice {twice[:10]}, missing {gaps[:10]}")
        elif any(seq != step for step, seq in records):
            point.fail(f"{when}: {writer}: a record at the wrong step: {[r for r in records if r[0] != r[1]][:5]}")
    lost = sorted(kept - stored(seen))
    point.tally[f"records lost ({when})"] += len(lost)
    if lost:
        point.fail(f"{when}: {len(lost)} acknowledged records are not in the buffer: {lost[:10]}")


def stored(seen: Look) -> set[tuple[str, int]]:
    """(writer, step) of every record read."""
    return {(name.split("/", 1)[1], step) for name, records in seen.records.items() for step, _ in records}


def arrivals(server: FakeWandb) -> Counter:
    """How many rows the server holds per (writer, step), over all its runs."""
    rows: Counter = Counter()
    for fake_run in list(server.runs.values()):
        for writer, axis in writers_in(fake_run):
            for step, _ in rows_of(fake_run, writer, axis):
                rows[(writer, step)] += 1
    return rows


def writers_in(fake_run: Any) -> set[tuple[str, str]]:
    """(writer, step axis) of every row's writer prefix: crash_point_writer.py's train ("step") and eval ("epoch")."""
    found = set()
    for row in fake_run.history:
        for key in row:
            writer, _, axis = key.rpartition("/")
            if axis in ("step", "epoch") and writer and "/" not in writer:
                found.add((writer, axis))
    return found


# -- the scenarios: a buffer, an actor, what it must leave -----------------------------------------


@dataclass
class Point:
    """One kill: what was tallied, and what went wrong."""

    tally: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failures.append(what)


def buffer_in(folder: Path, kind: str) -> str:
    return str(folder / KINDS[kind].rstrip("/")) + ("/" if KINDS[kind].endswith("/") else "")


def base_env(server: FakeWandb | None = None) -> dict[str, str]:
    return {**os.environ, **(server.env() if server else {})}


@dataclass
class Acks:
    """What crash_point_writer.py (or crash_point_companion.py) said: acknowledged steps per writer id, config,
    summaries."""

    records: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    config: bool = False
    summaries: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, stdout: str) -> Acks:
        acks = cls()
        for line in stdout.splitlines():
            word, _, rest = line.partition(" ")
            if word == "config":
                acks.config = True
            elif word == "summary":
                acks.summaries.add(int(rest))
            elif word not in ("flushed", "closed") and rest.isdigit():
                acks.records[word].add(int(rest))
        return acks


def writer_command(buffer: str) -> list[str]:
    return [sys.executable, str(TESTS / "crash_point_writer.py"), buffer, str(LIVES), str(RECORDS)]


def delivered(point: Point, server: FakeWandb, seen: Look, before: set[tuple[str, int]]) -> None:
    """Every record of ``seen`` not synced ``before`` is at the server; rows that arrived twice are counted."""
    rows = arrivals(server)
    missing = []
    for name, records in seen.records.items():
        writer = name.split("/", 1)[1]
        for step, _ in records:
            if (writer, step) in before:
                continue
            point.tally["records to deliver"] += 1
            if rows[(writer, step)] == 0:
                missing.append((writer, step))
    point.tally["records missing at W&B"] += len(missing)
    point.tally["rows received more than once"] += sum(n - 1 for n in rows.values() if n > 1)
    if missing:
        point.fail(f"{len(missing)} records never reached W&B: {missing[:10]}")


def recover(point: Point, buffer: str, server: FakeWandb, kept: set[tuple[str, int]]) -> Look | None:
    """A clean `walbuf sync`, which must exit 0 and leave nothing pending and nothing damaged, ``kept`` among the
    records; what it left."""
    synced = run_bounded([sys.executable, "-m", "walbuf", "sync", buffer, "--quiet"], base_env(server))
    if synced.returncode != 0:
        point.fail(f"the sync after the kill exited {synced.returncode}: {synced.said()}")
        return None
    after = look_here(buffer)
    if after.status is None:
        point.fail(f"the buffer could not be read after the sync: {after.errors}")
        return None
    if pending(after):
        point.fail(f"the sync after the kill exited 0 and left {pending(after)} records pending")
    found_damage(point, after, "after the sync")
    for check, ok, detail in after.doctor:
        if not ok and not any(what.startswith(f"doctor: {check}:") for what in damage(after)):
            point.fail(f"after the sync, doctor says a person is needed: {check}: {detail}")
    check_records(point, after, "after the sync", kept)
    return after


class Companion:
    """crash_point_companion.py, started once the writer under strace said its first line (the buffer is there),
    fed a line for each record that writer acknowledges: the two log at once."""

    def __init__(self, buffer: str, folder: Path) -> None:
        self.buffer, self.folder = buffer, folder
        self.proc: subprocess.Popen[bytes] | None = None
        self.errors = folder / "companion.err"
        self.gone = False  # its stdin broke: it ended early (its output says why)

    def heard(self, line: str) -> None:
        """A line of the writer under strace."""
        if self.proc is None:
            with self.errors.open("wb") as errors:
                self.proc = subprocess.Popen(
                    [sys.executable, str(TESTS / "crash_point_companion.py"), self.buffer],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    env=base_env(),
                    start_new_session=True,
                )
        word, _, step = line.partition(" ")
        if word in ("train", "eval") and step.isdigit() and not self.gone:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(b"\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                self.gone = True

    def end(self) -> Ran | None:
        """Close its stdin and let it close its writer (None if it never started)."""
        if self.proc is None:
            return None
        try:
            out, _ = self.proc.communicate(timeout=TIMEOUT)  # closes its stdin first
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            out, _ = self.proc.communicate()
            return Ran(None, out.decode(errors="replace"), self.errors.read_text(errors="replace"))
        except BrokenPipeError:
            out, _ = self.proc.communicate()
        return Ran(self.proc.returncode, out.decode(errors="replace"), self.errors.read_text(errors="replace"))


def crash_writer(kind: str, syscall: str | None, when: int, folder: Path) -> tuple[Point, Traced]:
    """The writer actor, with its companion, killed at its ``when``-th call of ``syscall`` (0: run to its end), and
    every check after."""
    point = Point()
    buffer = buffer_in(folder, kind)
    companion = Companion(buffer, folder)
    traced = under_strace(writer_command(buffer), base_env(), folder / "trace", syscall, when, companion.heard)
    ran = traced.ran
    beside = companion.end()
    if ran.hung:
        point.tally["points where a process hung"] += 1
        point.fail(f"the writer hung (killed after {TIMEOUT:g}s): {ran.said()}")
        return point, traced
    tell_kill(point, traced, when)
    if ran.returncode not in (0, -signal.SIGKILL):
        point.fail(f"the writer failed by itself ({ran.returncode}): {ran.said()}")
    acks = Acks.of(ran.stdout)
    acked = {(writer, step) for writer, steps in acks.records.items() for step in steps}
    point.tally["records acknowledged"] += len(acked)
    if beside is not None:
        if beside.hung:
            point.tally["points where a process hung"] += 1
            point.fail(f"the companion writer hung (killed {TIMEOUT:g}s after it was told to close): {beside.said()}")
        elif beside.returncode != 0:
            point.fail(f"the companion writer failed ({beside.returncode}): {beside.said()}")
        companion_acks = Acks.of(beside.stdout)
        point.tally["records acknowledged by the companion"] += sum(map(len, companion_acks.records.values()))
        acked |= {(writer, step) for writer, steps in companion_acks.records.items() for step in steps}
    seen, checked = look(buffer, base_env(), ("train:step:crash", "eval:epoch"))
    if seen is None:
        point.fail(f"the buffer could not be read after the kill: {checked.said()}")
        return point, traced
    found_damage(point, seen, "after the kill")
    check_records(point, seen, "after the kill", acked)
    in_flight = stored(seen) - acked
    point.tally["records stored, killed before log() returned"] += len(in_flight)
    if len(in_flight) > 1 or any(writer == "companion" for writer, _ in in_flight):
        point.fail(f"records stored that no log() returned for (one of the writer at most): {sorted(in_flight)}")
    if seen.reopened is None:
        point.fail(f"the writers could not be opened again after the kill: {checked.said()}")
        return point, traced
    for writer, step in seen.reopened.items():
        if step != len(seen.records.get(f"{RUN}/{writer}", [])):
            point.fail(f"{writer} opened again logged step {step}, not {len(seen.records.get(f'{RUN}/{writer}', []))}")
    with FakeWandb() as server:
        after = recover(point, buffer, server, acked)
        if after is None:
            return point, traced
        delivered(point, server, after, set())
        fake_run = next(iter(server.runs.values()))
        if acks.config and fake_run.config.get("lr", {}).get("value") != 0.001:
            point.fail(f"the acknowledged config did not reach W&B: {fake_run.config}")
        summaries = {life for life in acks.summaries if f"best_loss_{life}" not in fake_run.summary}
        if summaries:
            point.fail(f"acknowledged summaries of lives {sorted(summaries)} did not reach W&B: {fake_run.summary}")
    return point, traced


def tell_kill(point: Point, traced: Traced, when: int) -> None:
    """Tally which programs strace killed (none: no thread reached its ``when``-th call)."""
    if not when:
        return
    point.tally["points"] += 1
    if not traced.hits:
        point.tally["points no thread reached"] += 1
    for program in sorted({hit.program for hit in traced.hits}):
        point.tally[f"kills of {program}"] += 1
    for hit in traced.hits:
        point.tally[f"kills at {hit.where}"] += 1


# -- the syncer's buffer, filled once per kind -------------------------------------------------------


@dataclass
class Filled:
    """A buffer to copy for each syncer kill, and the records a sync sent from it before (to another server)."""

    template: Path
    synced: set[tuple[str, int]]


def fill(kind: str, folder: Path) -> Filled:
    """Writers, a sync, more writers (a new life of one, one killed while open): records synced and not, several
    writers, one dead; in a directory buffer, ingested, sealed and live shards (the dead writer's)."""
    buffer = buffer_in(folder, kind)
    for prefix, lives, records in (("r0-", 2, 500), ("r1-", 1, 500)):
        wrote = run_bounded([*writer_command(buffer)[:2], buffer, str(lives), str(records), prefix], base_env())
        assert wrote.returncode == 0, wrote.said()
    with FakeWandb() as server:
        first = run_bounded([sys.executable, "-m", "walbuf", "sync", buffer, "--quiet"], base_env(server))
        assert first.returncode == 0, first.said()
    seen = look_here(buffer)
    assert not seen.errors, seen.errors
    synced = {(name.split("/", 1)[1], step) for name, records in seen.records.items() for step, _ in records}
    for prefix, lives, records in (("r0-", 1, 500), ("r1-", 1, 300)):
        wrote = run_bounded([*writer_command(buffer)[:2], buffer, str(lives), str(records), prefix], base_env())
        assert wrote.returncode == 0, wrote.said()
    with staying_writer(buffer, "k-", 300) as killed:
        killed.kill()
    return Filled(Path(buffer.rstrip("/")), synced)


class Staying:
    """A crash_point_writer.py process whose train writer stays open until :meth:`close` (or :meth:`kill`)."""

    def __init__(self, buffer: str, prefix: str, records: int) -> None:
        self.proc = subprocess.Popen(
            [*writer_command(buffer)[:2], buffer, "1", str(records), prefix, "stay"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=base_env(),
            start_new_session=True,
        )
        self.out = self.wait_for(b"staying\n")

    def wait_for(self, line: bytes) -> bytes:
        """What it printed up to ``line`` (an event: it printed it once its writers committed)."""
        assert self.proc.stdout is not None
        seen = b""
        deadline = time.monotonic() + TIMEOUT
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while not seen.endswith(line):
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    kill_group(self.proc.pid)
                    raise AssertionError(f"the staying writer did not say {line!r} in {TIMEOUT}s: {seen[-500:]!r}")
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    assert self.proc.stderr is not None
                    err = self.proc.stderr.read().decode(errors="replace")
                    raise AssertionError(f"the staying writer ended before it said {line!r}: {seen[-500:]!r} {err}")
                seen += chunk
        return seen

    def close(self) -> Ran:
        """Let it close its writer and end (communicate closes its stdin)."""
        try:
            out, err = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            out, err = self.proc.communicate()
            return Ran(None, out.decode(errors="replace"), err.decode(errors="replace"))
        return Ran(self.proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

    def kill(self) -> None:
        kill_group(self.proc.pid)
        self.proc.communicate(timeout=TIMEOUT)


class staying_writer:  # noqa: N801 - used as a context manager, like open()
    def __init__(self, buffer: str, prefix: str, records: int) -> None:
        self.args = (buffer, prefix, records)

    def __enter__(self) -> Staying:
        self.writer = Staying(*self.args)
        return self.writer

    def __exit__(self, *exc: object) -> None:
        if self.writer.proc.poll() is None:
            self.writer.kill()
        for stream in (self.writer.proc.stdout, self.writer.proc.stderr):
            if stream is not None:
                stream.close()


def crash_syncer(kind: str, filled: Filled, syscall: str | None, when: int, folder: Path) -> tuple[Point, Traced]:
    """`walbuf sync` of a copy of the filled buffer, with a writer open meanwhile, killed at its ``when``-th call of
    ``syscall`` (0: run to its end); every check after."""
    point = Point()
    buffer = buffer_in(folder, kind)
    copy(filled.template, Path(buffer.rstrip("/")))
    with FakeWandb() as server, staying_writer(buffer, "o-", 100) as open_writer:
        sync = [sys.executable, "-m", "walbuf", "sync", buffer, "--quiet"]
        traced = under_strace(sync, base_env(server), folder / "trace", syscall, when)
        ran = traced.ran
        closed = open_writer.close()
        if ran.hung:
            point.tally["points where a process hung"] += 1
            point.fail(f"the sync hung (killed after {TIMEOUT:g}s): {ran.said()}")
            return point, traced
        tell_kill(point, traced, when)
        if closed.hung:
            point.tally["points where a process hung"] += 1
        if closed.returncode != 0:
            point.fail(f"the writer open during the sync could not close ({closed.returncode}): {closed.said()}")
        acks = Acks.of(open_writer.out.decode())
        kept = filled.synced | {(writer, step) for writer, steps in acks.records.items() for step in steps}
        seen = look_here(buffer)  # nothing runs on it any more: strace ended once every process it traced had
        found_damage(point, seen, "after the kill")
        if cut_off(seen):
            point.tally["kills that left the hub's transaction for the next sync to roll back"] += 1
        else:
            check_records(point, seen, "after the kill", kept)
        if ran.returncode is not None and ran.returncode >= 0:  # walbuf sync ended by itself
            point.tally[f"syncs that exited {ran.returncode}"] += 1
            if ran.returncode != 0 and ("Traceback" in ran.stderr or "walbuf: error:" not in ran.stderr):
                point.fail(f"the sync failed ({ran.returncode}) without saying why in walbuf's words: {ran.said()}")
            if ran.returncode != 0 and seen.status is not None and pending(seen) != len(stored(seen) - filled.synced):
                point.fail(
                    f"the sync failed ({ran.returncode}) and marked records synced:"
                    f" {len(stored(seen) - filled.synced) - pending(seen)} of them"
                )
        elif ran.returncode != -signal.SIGKILL:
            point.fail(f"the sync ended by signal {-(ran.returncode or 0)}: {ran.said()}")
        after = recover(point, buffer, server, kept)
        if after is not None:
            delivered(point, server, after, filled.synced)
    return point, traced


def copy(template: Path, to: Path) -> None:
    """The buffer's files as they are (modes too): no process has them open."""
    if template.is_dir():
        shutil.copytree(template, to, symlinks=True)
        return
    to.parent.mkdir(parents=True, exist_ok=True)
    for path in template.parent.iterdir():
        if path.name.startswith(template.name):
            if path.is_dir():
                shutil.copytree(path, to.parent / path.name.replace(template.name, to.name, 1), symlinks=True)
            else:
                shutil.copy2(path, to.parent / path.name.replace(template.name, to.name, 1))


# -- the tests -------------------------------------------------------------------------------------


Case = tuple[str, str, str]  # (kind, actor, syscall)


@dataclass
class Outcome:
    """A case's points: each N killed at, with the point it made."""

    calls: dict[str, int]  # program -> the most calls of the syscall one of its threads made in the clean run
    points: list[tuple[int, Future[tuple[Point, Traced]]]]


class Harness:
    """What the module's tests share: one pool of points, each kind's filled buffer, each clean run's counts, the
    table.

    Every point of every case selected is handed to one pool as soon as
    its clean run has counted the calls (which the pool runs too): a
    point is processes of its own, which wait on each other and on
    wandb-core much of the time, so JOBS of them at once keep the cores
    busy. Each test then waits for its own points.
    """

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.pool = ThreadPoolExecutor(max_workers=jobs())
        self.lock = threading.Lock()
        self.filled: dict[str, Future[Filled]] = {}
        self.clean: dict[tuple[str, str], Future[Traced]] = {}
        self.cases: dict[Case, Future[Outcome]] = {}
        self.rows: list[dict[str, Any]] = []

    def start(self, cases: list[Case]) -> None:
        """Hand every point of ``cases`` to the pool (each as soon as its clean run counted the calls)."""
        for case in cases:
            self.outcome(case)

    def outcome(self, case: Case) -> Future[Outcome]:
        with self.lock:
            if case not in self.cases:
                kind, actor, syscall = case
                if actor == "syncer" and kind not in self.filled:
                    self.filled[kind] = self.pool.submit(fill, kind, self.factory.mktemp(f"filled-{kind}"))
                if (kind, actor) not in self.clean:
                    self.clean[(kind, actor)] = self.pool.submit(self.crash, kind, actor, None, 0)
                chained: Future[Outcome] = Future()
                self.clean[(kind, actor)].add_done_callback(lambda done: self.hand_points(case, done, chained))
                self.cases[case] = chained
            return self.cases[case]

    def hand_points(self, case: Case, clean: Future[tuple[Point, Traced]], outcome: Future[Outcome]) -> None:
        """Once the clean run counted the calls, hand the case's points to the pool."""
        kind, actor, syscall = case
        try:
            point, traced = clean.result()
            assert not point.failures, f"a clean run of the {actor} on a {kind} buffer failed: {point.failures}"
            assert traced.ran.returncode == 0, f"a clean run of the {actor} on a {kind} buffer: {traced.ran.said()}"
        except BaseException as exc:  # noqa: BLE001 - told to the test, which raises it
            outcome.set_exception(exc)
            return
        calls = traced.counts.get(syscall, {})
        whens = chosen() or spread(max(calls.values(), default=0), points_wanted())
        outcome.set_result(Outcome(calls, [(n, self.pool.submit(self.crash, kind, actor, syscall, n)) for n in whens]))

    def crash(self, kind: str, actor: str, syscall: str | None, when: int) -> tuple[Point, Traced]:
        folder = self.factory.mktemp(f"{kind}-{actor}-{syscall}-{when}")
        try:
            if actor == "writer":
                return crash_writer(kind, syscall, when, folder)
            return crash_syncer(kind, self.filled[kind].result(), syscall, when, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def table(self) -> str:
        head = (
            "| kind | actor | syscall | calls in a clean run (most by one thread) | points | killed |"
            " lost | twice in the buffer | damaged | missing at W&B | rows twice at W&B | points failed |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|"
        )
        lines = [head]
        for row in sorted(self.rows, key=lambda r: (r["kind"], ACTORS.index(r["actor"]), SYSCALLS.index(r["syscall"]))):
            t = row["tally"]
            calls = ", ".join(f"{p} {n}" for p, n in sorted(row["calls"].items())) or "none"
            killed = [f"{k.removeprefix('kills of ')} {n}" for k, n in sorted(t.items()) if k.startswith("kills of ")]
            if t.get("points no thread reached"):
                killed.append(f"none {t['points no thread reached']}")
            lost = t.get("records lost (after the kill)", 0) + t.get("records lost (after the sync)", 0)
            lines.append(
                f"| {row['kind']} | {row['actor']} | {row['syscall']} | {calls} | {t.get('points', 0)} |"
                f" {', '.join(killed) or '-'} | {lost} | {t.get('records twice in the buffer', 0)} |"
                f" {t.get('points that found damage', 0)} | {t.get('records missing at W&B', 0)} |"
                f" {t.get('rows received more than once', 0)} | {t.get('points that failed', 0)} |"
            )
        return "\n".join(lines)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Harness]:
    why_not = strace_works()
    if why_not is not None:
        pytest.skip(why_not)
    found = Harness(tmp_path_factory)
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist a worker runs some cases only: each as it comes
        found.start(
            [
                (item.callspec.params["kind"], item.callspec.params["actor"], item.callspec.params["syscall"])
                for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
            ]
        )
    try:
        yield found
    finally:
        for future in found.cases.values():
            future.cancel()
        found.pool.shutdown(wait=True, cancel_futures=True)
    if found.rows:
        table = found.table()
        print(f"\ncrash points ({points_wanted()} per syscall):\n{table}")
        cache = getattr(request.config, "cache", None)
        if cache is not None:
            cache.set("walbuf/crash-points/table", table)


@pytest.mark.parametrize("syscall", SYSCALLS)
@pytest.mark.parametrize("actor", ACTORS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_killed_at_the_nth_call_keeps_every_acknowledged_record_and_the_next_sync_delivers_it(
    harness: Harness, request: pytest.FixtureRequest, kind: str, actor: str, syscall: str
) -> None:
    outcome = harness.outcome((kind, actor, syscall)).result()
    tally: Counter = Counter()
    failures: list[str] = []
    hits: dict[int, str] = {}
    for when, future in outcome.points:
        point, traced = future.result()
        tally.update(point.tally)
        hits[when] = "; ".join(f"{h.program}: {h.call}" for h in traced.hits) or "no thread reached it"
        failures += [f"when={when} ({hits[when]}): {what}" for what in point.failures]
        tally["points that failed"] += bool(point.failures)
    harness.rows.append({"kind": kind, "actor": actor, "syscall": syscall, "calls": outcome.calls, "tally": tally})
    report(request, tally, outcome.calls, hits)
    if not outcome.points:
        pytest.skip(f"a clean run of the {actor} on a {kind} buffer makes no {syscall} call")
    assert not failures, f"{len(failures)} points failed:\n" + "\n".join(failures)


def report(request: pytest.FixtureRequest, tally: Counter, calls: dict[str, int], hits: dict[int, str]) -> None:
    """Print what a test exercised, and keep it in pytest's cache (as test_crashes.py does)."""
    counts = {"calls in a clean run": calls, **dict(sorted(tally.items()))}
    if len(hits) <= 20:  # a full sweep's are told by the "kills at" counts
        counts["killed at"] = hits
    print(f"{request.node.name}: {json.dumps(counts, indent=1)}")
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        cache.set(f"walbuf/crash-points/{request.node.name}", counts)


# -- making a shard, where a kill once left a live shard that made doctor fail for good -------------------

# Under strace -y: the write of a shard's head (to a file in live/, starting with a frame of its process: magic, "P").
HEAD_WRITE = re.compile(r'(\d+)<[^>]*> write\(\d+<[^>]*/live/[^>]*>, "\\247\\37P')


def head_writes(trace: Path) -> list[int]:
    """The calls (strace's when=: its thread's count of write) that write a shard's head, in a trace of -f -Y -y."""
    calls: Counter = Counter()
    found = []
    for line in trace.read_text(errors="replace").splitlines():
        if m := CALL.match(line):
            calls[(m[3], m[1])] += 1
            if HEAD_WRITE.match(line):
                found.append(calls[(m[3], m[1])])
    return found


def set_back_past_dead_after(buffer: str) -> None:
    """What is in live/ as if nothing was written to it for twice WALBUF_DEAD_AFTER (instead of waiting that long)."""
    then = time.time() - 2 * silent_after()
    for path in Path(buffer, "live").rglob("*"):
        if path.is_file():
            os.utime(path, (then, then), follow_symlinks=False)


def test_a_writer_killed_as_it_writes_a_new_shards_first_frame_leaves_nothing_a_sync_or_doctor_stumbles_on_ever(
    tmp_path,
):
    # A shard's head (its process's frame, its writers') is its first write.
    # A process killed there leaves an empty live shard whose process no sync
    # can name: none seals it (one stopped there would go on writing into it),
    # and doctor failed once WALBUF_DEAD_AFTER had passed, for good. Each life
    # of crash_point_writer.py makes a new shard: killed at each head's write.
    why_not = strace_works()
    if why_not is not None:
        pytest.skip(why_not)
    clean = tmp_path / "clean"
    clean.mkdir()
    counted = under_strace(writer_command(buffer_in(clean, "directory")), base_env(), clean / "trace", None, 0)
    assert counted.ran.returncode == 0, counted.ran.said()
    points = head_writes(clean / "trace")
    assert len(points) == LIVES, points
    failures = {}
    for when in points:
        folder = tmp_path / f"write-{when}"
        folder.mkdir()
        buffer = buffer_in(folder, "directory")
        traced = under_strace(writer_command(buffer), base_env(), folder / "trace", "write", when)
        assert traced.ran.returncode == -signal.SIGKILL and traced.hits, traced.ran.said()
        acks = Acks.of(traced.ran.stdout)
        acked = {(writer, step) for writer, steps in acks.records.items() for step in steps}
        point = Point()
        with FakeWandb() as server:
            recover(point, buffer, server, acked)  # at once: doctor passes, the sync exits 0
            set_back_past_dead_after(buffer)
            after = recover(point, buffer, server, acked)  # and for good
            if after is not None:
                delivered(point, server, after, set())
        held = [str(path) for path in Path(buffer, "live").rglob("*") if path.is_file() and path.stat().st_size]
        if held:
            point.fail(f"left in live/ with something in it after the syncs: {held}")
        if point.failures:
            failures[f"write {when}"] = point.failures
    assert not failures
