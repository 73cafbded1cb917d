"""How long one log() waits when many processes log into one SQLite buffer at once, against bare sqlite3.

Two cases, each with walbuf and a bare sqlite3 autocommit INSERT of the same
row (WAL, synchronous=NORMAL, 60 s busy timeout, 1 KiB pages, as walbuf
sets them) side by side, in alternating rounds:

- saturating: --processes processes each log --per-process records as fast
  as they can;
- DDP-like: --ranks processes log one record each at the same instant (a
  barrier), --steps times, as the ranks of a data-parallel job do per step.

Printed per case and contender: records/s together (saturating), and the
per-call durations over all rounds: p50, p99, p99.9, max.

A third contender, "no lock", shares nothing: each call runs a loop whose
iterations take as long as one uncontended walbuf log() on this machine
(calibrated first). Its tail is what the scheduler alone adds when more
processes run than there are cores: no lock, however fair, makes a call
wait less than that.

    python scripts/bench_contention.py [--processes 16] [--per-process 3000] [--ranks 8] [--steps 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sqlite3
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


def _logger(kind: str, path: str, index: int) -> Any:
    """A function that logs one record (walbuf's log(), or the bare INSERT), or the "no lock" loop."""
    if kind == "no lock":
        iterations = int(path)
        return lambda: _spin(iterations)
    if kind == "walbuf":
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
    """Loop iterations that take as long as one uncontended walbuf log() (medians, one process)."""
    calls = []
    with walbuf.Writer(_prepare("walbuf", directory), writer="calibration", run="bench") as writer:
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
    if kind == "no lock":
        return LOOP
    path = str(directory / f"{kind}-{uuid.uuid4().hex}.db")
    if kind == "walbuf":
        walbuf.Writer(path, writer="setup", run="bench").close()  # the schema, before the clock
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


def describe(durations: list[float]) -> str:
    ordered = sorted(durations)

    def at(q: float) -> float:  # nearest rank, in ms
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return f"p50 {at(0.5):.3f}  p99 {at(0.99):.2f}  p99.9 {at(0.999):.2f}  max {ordered[-1] * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--per-process", type=int, default=3000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    global LOOP
    kinds = ("walbuf", "bare sqlite3", "no lock")
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    saturated: dict[str, list[float]] = {k: [] for k in kinds}
    ddp: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        LOOP = str(calibrate(Path(tmp)))
        for r in range(args.rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                rate, durations = saturating_round(kind, Path(tmp), args.processes, args.per_process)
                rates[kind].append(rate)
                saturated[kind] += durations
                ddp[kind] += ddp_round(kind, Path(tmp), args.ranks, args.steps)
    print(f"{args.processes} processes logging as fast as they can ({args.rounds} rounds of {args.per_process} each):")
    for kind in kinds:
        best = sorted(rates[kind])[len(rates[kind]) // 2]
        print(f"  {kind:<13} {best:>9,.0f} records/s (median round)  {describe(saturated[kind])}")
    print(f"{args.ranks} ranks logging at one instant per step ({args.rounds} rounds of {args.steps} steps):")
    for kind in kinds:
        print(f"  {kind:<13} {describe(ddp[kind])}")


if __name__ == "__main__":
    main()
