"""Benchmark of the writer, measured side by side in one run and printed as ratios.

1. walbuf's Writer.log() against a bare sqlite3 autocommit INSERT of the same
   row (same columns, same JSON text) in WAL mode with synchronous=NORMAL.
2. Writer.log() against wandb.log() in wandb's offline mode.
3. 16 writer processes logging into one buffer at once: records/s together.

Rounds alternate between the contenders so that machine noise hits both.

    python scripts/bench_writer.py [--records N] [--rounds R] [--processes P]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import bench_backends  # scripts/ is on sys.path when this runs as a script

import walbuf
from walbuf.record import encode

METRICS = {"train/loss": 0.6931, "train/accuracy": 0.5, "lr": 3e-4}

BARE_SCHEMA = (
    "CREATE TABLE records (id INTEGER PRIMARY KEY, writer_id INTEGER NOT NULL,"
    " step BIGINT NOT NULL, time FLOAT NOT NULL, metrics TEXT NOT NULL)"
)


def time_walbuf(writer: walbuf.Writer, n: int) -> float:
    log = writer.log
    start = time.perf_counter()
    for _ in range(n):
        log(METRICS)
    return (time.perf_counter() - start) / n


def time_bare(conn: sqlite3.Connection, n: int, first_step: int) -> float:
    # The same row walbuf writes: the metrics serialised, the time taken per call.
    execute = conn.execute
    sql = "INSERT INTO records (writer_id, step, time, metrics) VALUES (?, ?, ?, ?)"
    start = time.perf_counter()
    for step in range(first_step, first_step + n):
        execute(sql, (1, step, time.time(), encode(METRICS)))
    return (time.perf_counter() - start) / n


def time_wandb_offline(run: object, n: int) -> float:
    log = run.log  # type: ignore[attr-defined]
    start = time.perf_counter()
    for _ in range(n):
        log(METRICS)
    return (time.perf_counter() - start) / n


def concurrent_rate(directory: Path, processes: int, n: int) -> float:
    return bench_backends.rate(str(directory / "concurrent.db"), processes, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000, help="records per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--per-process", type=int, default=10_000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        os.environ["WANDB_DIR"] = str(directory)
        os.environ["WANDB_SILENT"] = "true"
        import wandb

        writer = walbuf.Writer(directory / "walbuf.db", writer="bench", run="bench")
        bare = sqlite3.connect(directory / "bare.db", isolation_level=None)
        bare.execute("PRAGMA journal_mode=WAL")
        bare.execute("PRAGMA synchronous=NORMAL")
        bare.execute(BARE_SCHEMA)
        run = wandb.init(mode="offline", project="walbuf-bench", dir=str(directory))

        ours, theirs, offline = [], [], []
        wandb_n = max(1, args.records // 10)  # offline wandb is slow; fewer calls, same per-call figure
        for r in range(args.rounds):
            ours.append(time_walbuf(writer, args.records))
            theirs.append(time_bare(bare, args.records, r * args.records))
            offline.append(time_wandb_offline(run, wandb_n))
        run.finish()
        writer.close()
        bare.close()

        log_us = statistics.median(ours) * 1e6
        bare_us = statistics.median(theirs) * 1e6
        wandb_us = statistics.median(offline) * 1e6
        rate = concurrent_rate(directory, args.processes, args.per_process)

    print(f"Writer.log()                : {log_us:7.1f} us/record (median of {args.rounds} rounds)")
    print(f"bare sqlite3 INSERT         : {bare_us:7.1f} us/record")
    print(f"wandb.log (offline)         : {wandb_us:7.1f} us/record")
    print(f"log() / bare INSERT         : {log_us / bare_us:5.2f}x   (target <= 1.5x)")
    print(f"offline wandb.log / log()   : {wandb_us / log_us:5.2f}x   (target >= 5x)")
    print(f"{args.processes} processes, one buffer : {rate:,.0f} records/s together (target >= 50,000)")


if __name__ == "__main__":
    main()
