"""How long one log() waits when many processes log into one buffer at once: a SQLite file and a directory buffer,
against bare sqlite3 and a contender that shares nothing.

Two cases, each with the contenders side by side, in alternating rounds:

- saturating: --processes processes each log --per-process records as fast
  as they can;
- DDP-like: --ranks processes log one record each at the same instant (a
  barrier), --steps times, as the ranks of a data-parallel job do per step.

The contenders: walbuf into one SQLite file, walbuf into one directory buffer
(each process appends to a shard of its own), a bare sqlite3 autocommit
INSERT of the same row into one file (WAL, synchronous=NORMAL, 60 s busy
timeout, 1 KiB pages, as walbuf sets them), and "no lock", which shares
nothing: each call runs a loop whose iterations take as long as one
uncontended log() into a directory buffer on this machine (calibrated
first). Its tail is what the scheduler alone adds when more processes run
than there are cores: no writer, however it shares the buffer, makes a call
wait less than that.

Printed per case and contender: records/s together (saturating, the median
round), and the per-call durations over all rounds: p50, p99, p99.9, max;
then the tail goal (issue 36, now the directory buffer's): in the saturating
case, p99.9 within 1.25x of no lock's at no less than bare sqlite3's rate,
each the median of the rounds' ratios.

    python scripts/bench_contention.py [--processes 16] [--per-process 3000] [--ranks 8] [--steps 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import sqlite3
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import walbuf
from walbuf.record import encode

METRICS = {"train/loss": 0.6931, "train/accuracy": 0.5, "lr": 3e-4}
BARE_SCHEMA = (
    "CREATE TABLE records (id INTEGER PRIMARY KEY, writer_id INTEGER NOT NULL,"
    " step BIGINT NOT NULL, time FLOAT NOT NULL, metrics TEXT NOT NULL)"
)


def _bare_buffer(path: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA page_size=1024")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(BARE_SCHEMA)
    conn.close()


def _spin(iterations: int) -> None:
    for _ in range(iterations):
        pass


SQLITE, DIRECTORY, BARE, NO_LOCK = "walbuf sqlite", "walbuf directory", "bare sqlite3", "no lock"
KINDS = (SQLITE, DIRECTORY, BARE, NO_LOCK)
GOAL_TAIL, GOAL_RATE = 1.25, 1.0  # the directory buffer's p99.9 against no lock's, its rate against bare's


def _logger(kind: str, path: str, index: int) -> Any:
    """A function that logs one record (walbuf's log(), or the bare INSERT), or the "no lock" loop."""
    if kind == NO_LOCK:
        iterations = int(path)
        return lambda: _spin(iterations)
    if kind in (SQLITE, DIRECTORY):
        writer = walbuf.Writer(path, writer=f"proc-{index}", run="bench")
        return lambda: writer.log(METRICS)
    conn = sqlite3.connect(path, isolation_level=None, timeout=60)
    conn.execute("PRAGMA synchronous=NORMAL")
    sql = "INSERT INTO records (writer_id, step, time, metrics) VALUES (?, ?, ?, ?)"
    step = iter(range(10**9))
    return lambda: conn.execute(sql, (index, next(step), time.time(), encode(METRICS)))


def _saturating(kind: str, path: str, index: int, n: int, ready: Any, go: Any, out: Any) -> None:
    log = _logger(kind, path, index)
    durations = []
    ready.release()
    go.wait()
    for _ in range(n):
        start = time.perf_counter()
        log()
        durations.append(time.perf_counter() - start)
    out.put(durations)


def _ddp(kind: str, path: str, index: int, steps: int, barrier: Any, out: Any) -> None:
    log = _logger(kind, path, index)
    durations = []
    for _ in range(steps):
        barrier.wait()  # every rank reaches the step's log() at once
        start = time.perf_counter()
        log()
        durations.append(time.perf_counter() - start)
    out.put(durations)


def calibrate(directory: Path) -> int:
    """Loop iterations that take as long as one uncontended log() into a directory buffer (medians, one process)."""
    calls = []
    with walbuf.Writer(_prepare(DIRECTORY, directory), writer="calibration", run="bench") as writer:
        for _ in range(3000):
            start = time.perf_counter()
            writer.log(METRICS)
            calls.append(time.perf_counter() - start)
    loops = []
    for _ in range(300):
        start = time.perf_counter()
        _spin(10_000)
        loops.append(time.perf_counter() - start)
    return max(1, int(10_000 * sorted(calls)[len(calls) // 2] / sorted(loops)[len(loops) // 2]))


LOOP = ""  # "no lock"'s iterations, as its "path" (set in main)


def _prepare(kind: str, directory: Path) -> str:
    if kind == NO_LOCK:
        return LOOP
    if kind == DIRECTORY:
        path = str(directory / f"directory-{uuid.uuid4().hex}") + "/"
    else:
        path = str(directory / f"{kind.replace(' ', '-')}-{uuid.uuid4().hex}.db")
    if kind in (SQLITE, DIRECTORY):
        walbuf.Writer(path, writer="setup", run="bench").close()  # the schema or folders, before the clock
    else:
        _bare_buffer(path)
    return path


def saturating_round(kind: str, directory: Path, processes: int, n: int) -> tuple[float, list[float]]:
    ctx = mp.get_context("fork")
    path = _prepare(kind, directory)
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_saturating, args=(kind, path, i, n, ready, go, out)) for i in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()
    start = time.perf_counter()
    go.set()
    durations = [d for _ in procs for d in out.get()]
    elapsed = time.perf_counter() - start
    for p in procs:
        p.join()
    return processes * n / elapsed, durations


def ddp_round(kind: str, directory: Path, ranks: int, steps: int) -> list[float]:
    ctx = mp.get_context("fork")
    path = _prepare(kind, directory)
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_ddp, args=(kind, path, i, steps, barrier, out)) for i in range(ranks)]
    for p in procs:
        p.start()
    durations = [d for _ in procs for d in out.get()]
    for p in procs:
        p.join()
    return durations


def quantile(durations: list[float], q: float) -> float:
    """The nearest-rank quantile ``q`` of ``durations``, in ms."""
    ordered = sorted(durations)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def describe(durations: list[float]) -> str:
    at = functools.partial(quantile, durations)
    return f"p50 {at(0.5):.3f}  p99 {at(0.99):.2f}  p99.9 {at(0.999):.2f}  max {max(durations) * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--per-process", type=int, default=3000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    global LOOP
    rates: dict[str, list[float]] = {k: [] for k in KINDS}
    saturated: dict[str, list[list[float]]] = {k: [] for k in KINDS}  # each round's durations
    ddp: dict[str, list[float]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        LOOP = str(calibrate(Path(tmp)))
        for r in range(args.rounds):
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                rate, durations = saturating_round(kind, Path(tmp), args.processes, args.per_process)
                rates[kind].append(rate)
                saturated[kind].append(durations)
                ddp[kind] += ddp_round(kind, Path(tmp), args.ranks, args.steps)
    print(f"{args.processes} processes logging as fast as they can ({args.rounds} rounds of {args.per_process} each):")
    for kind in KINDS:
        every = [d for round_ in saturated[kind] for d in round_]
        print(f"  {kind:<16} {statistics.median(rates[kind]):>9,.0f} records/s (median round)  {describe(every)}")
    print(f"{args.ranks} ranks logging at one instant per step ({args.rounds} rounds of {args.steps} steps):")
    for kind in KINDS:
        print(f"  {kind:<16} {describe(ddp[kind])}")
    print("Saturating, medians of the rounds' ratios (rate against bare sqlite3, p99.9 against no lock):")
    for kind in (DIRECTORY, SQLITE):
        rate = statistics.median([a / b for a, b in zip(rates[kind], rates[BARE], strict=True)])
        tail = statistics.median(
            [quantile(a, 0.999) / quantile(b, 0.999) for a, b in zip(saturated[kind], saturated[NO_LOCK], strict=True)]
        )
        verdict = ""
        if kind == DIRECTORY:
            met = rate >= GOAL_RATE and tail <= GOAL_TAIL
            verdict = f"  goal (rate >= {GOAL_RATE}x, p99.9 <= {GOAL_TAIL}x): {'met' if met else 'NOT met'}"
        print(f"  {kind:<16} rate {rate:.2f}x  p99.9 {tail:.2f}x{verdict}")


if __name__ == "__main__":
    main()
