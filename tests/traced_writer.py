"""A writer process for tests/test_interrupts.py that interrupts itself at any line of Python, not only at syscalls.

Usage: traced_writer.py BUFFER POSITIONS

A Ctrl-C lands wherever the main thread next looks for signals. strace can
deliver SIGINT only as a syscall begins; here the main thread's profile
function (sys.setprofile) counts the points of one walbuf call where Python
looks for signals and, at the Nth, raises SIGINT (signal.raise_signal: the
real signal, whose handler raises KeyboardInterrupt there); its trace
function (sys.settrace) then raises a second one D Python calls later, in
whatever the first set going: a rollback, a close, a cut back. The calls
interrupted:
a log() of a new key (it claims the key in a write transaction of its own),
a log() of keys claimed before, and flush().

For each call, first counted uninterrupted, then at POSITIONS points spread
over its events (every one if POSITIONS is 0), once alone and once with a
second interruption 1, 4 and 16 events later. After each, with the writer
open, no connection of the buffer may be inside a transaction: SQLite,
another connection's BEGIN IMMEDIATE with no busy wait succeeds, once the
transactions the call handed over to run on without it ended; PostgreSQL
(the URL's application_name names the writer's sessions), none of them has a
transaction open. The first failure ends the loop.

Prints one line of JSON: "acked", [SEQ, STEP] for each log() that returned
(records ``{"seq": SEQ, "kK": 1.0}``); "interrupted", how many calls raised
KeyboardInterrupt; "raised", the other exceptions a call raised (name:
message); "problems"; "events", each call's count.
"""

import json
import signal
import sqlite3
import sys
from collections.abc import Callable
from typing import Any

import walbuf
from walbuf.store.interrupts import run_whole

buffer, positions = sys.argv[1], int(sys.argv[2])
writer = walbuf.Writer(buffer, writer="w", run="r")
acked: list[tuple[int, int]] = []
kept: list[BaseException] = []  # as a notebook keeps the last traceback, and with it every frame's locals
raised: list[str] = []
seq = 0


class Interrupter:
    """Raises SIGINT at the ``first``-th point where the main thread looks for signals, and again ``then`` function
    calls after it.

    CPython runs a signal's handler where its eval loop checks for one: as
    a Python function starts, after a call of a C function returns, and at
    a loop's jump back. The profile function sees the first two (its "call"
    and "c_return" events) and raises the signal there; it is unset by the
    exception, and the trace function (which sees Python calls only) raises
    the second.
    """

    def __init__(self, what: Callable[[], None], first: int | None, then: int | None) -> None:
        self.what, self.first, self.then = what.__code__, first, then
        self.inside = False  # in the call of ``what``, where the points are counted
        self.events = 0
        self.calls: int | None = None  # Python calls since the first interruption

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if frame.f_code is self.what and event in ("call", "return"):
            self.inside = event == "call"
        if self.inside and event in ("call", "c_return"):
            self.events += 1
            if self.events == self.first:
                self.calls = 0
                signal.raise_signal(signal.SIGINT)  # its handler raises KeyboardInterrupt, here

    def trace(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and self.calls is not None and self.then is not None:
            self.calls += 1
            if self.calls == self.then:
                self.then = None
                signal.raise_signal(signal.SIGINT)


def new_key() -> None:
    global seq
    step = writer.log({"seq": seq, f"k{seq}": 1.0})
    acked.append((seq, step))
    seq += 1


def same_keys() -> None:
    global seq
    step = writer.log({"seq": seq, "k0": 1.0})
    acked.append((seq, step))
    seq += 1


def flush() -> None:
    writer.flush()


def call(what: Callable[[], None], first: int | None = None, then: int | None = None) -> int:
    interrupter = Interrupter(what, first, then)
    try:
        try:
            sys.settrace(interrupter.trace)
            sys.setprofile(interrupter.profile)
            what()
        finally:
            sys.setprofile(None)
            sys.settrace(None)
    except KeyboardInterrupt as exc:
        kept.append(exc)
    except Exception as exc:
        kept.append(exc)
        raised.append(f"{type(exc).__name__}: {exc}")
    return interrupter.events


def transactions_open() -> list[str]:
    # First the transactions an interrupted call handed over end (they run
    # on without it): this waits behind them (see walbuf.store.interrupts).
    run_whole(lambda: None)
    if "://" not in buffer:
        if buffer.endswith("/"):
            return []  # a directory buffer's writer holds no transaction
        conn = sqlite3.connect(buffer, timeout=0, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        except sqlite3.OperationalError as exc:
            return [f"another connection cannot begin a write transaction: {exc}"]
        finally:
            conn.close()
        return []
    import sqlalchemy as sa

    url = sa.make_url(buffer)
    engine = sa.create_engine(url.set(query={k: v for k, v in url.query.items() if k != "application_name"}))
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT state, query FROM pg_stat_activity"
                    " WHERE application_name = :name AND state LIKE 'idle in transaction%'"
                ),
                {"name": url.query["application_name"]},
            ).all()
    finally:
        engine.dispose()
    return [f"a session of the writer is inside a transaction ({state}: {query})" for state, query in rows]


problems: list[str] = []
events: dict[str, int] = {}
interrupted = 0
for what in (new_key, same_keys, flush):
    call(what)  # the first of its kind may do more (the step axis's claim)
    count = events[what.__name__] = call(what)
    points = range(1, count + 1) if positions == 0 else sorted({1 + i * count // positions for i in range(positions)})
    for first in points:
        for then in (None, 1, 4, 16):
            before = len(kept)
            call(what, first, then)
            interrupted += len(kept) > before and isinstance(kept[-1], KeyboardInterrupt)
            problems += [f"{what.__name__}, interrupted at event {first} then {then}: {p}" for p in transactions_open()]
            if problems:
                break
        if problems:
            break
    if problems:
        break
print(
    json.dumps({"acked": acked, "interrupted": interrupted, "raised": raised, "problems": problems, "events": events})
)
writer.close()
