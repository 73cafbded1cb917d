"""Records/s of many writer processes into one buffer, SQLite against PostgreSQL, side by side.

For each process count (16 and 64 by default), rounds alternate between a
fresh SQLite buffer and a fresh PostgreSQL schema, so that machine noise hits
both; each round checks that every record arrived. Prints the median
records/s of each and their ratio.

    scripts/with-postgres python scripts/bench_backends.py [--processes 16 64] [--per-process N] [--rounds R]

The PostgreSQL URL comes from --postgres or WALBUF_TEST_POSTGRES (which
scripts/with-postgres sets, for a throwaway cluster on this machine).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

import walbuf

METRICS = {"train/loss": 0.6931, "train/accuracy": 0.5, "lr": 3e-4}


def _worker(buffer: str, index: int, n: int, ready: object, go: object) -> None:
    writer = walbuf.Writer(buffer, writer=f"proc-{index}", run="bench")
    ready.release()  # type: ignore[attr-defined]
    go.wait()  # type: ignore[attr-defined]
    for _ in range(n):
        writer.log(METRICS)
    writer.close()


def rate(buffer: str, processes: int, n: int) -> float:
    """Records/s of ``processes`` writers logging ``n`` records each into ``buffer`` at once."""
    walbuf.Writer(buffer, writer="setup", run="bench").close()  # schema made before the clock
    ctx = mp.get_context("fork")
    ready, go = ctx.Semaphore(0), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(buffer, i, n, ready, go)) for i in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()
    start = time.perf_counter()
    go.set()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - start
    if any(p.exitcode != 0 for p in procs):
        sys.exit("a writer process failed")
    count = sum(1 for r in walbuf.read(buffer, run="bench") if r.writer != "setup")
    if count != processes * n:
        sys.exit(f"lost records: {count} of {processes * n}")
    return processes * n / elapsed


def sqlite_round(directory: Path, processes: int, n: int) -> float:
    return rate(str(directory / f"{uuid.uuid4().hex}.db"), processes, n)


def postgres_round(url: str, processes: int, n: int) -> float:
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    try:
        return rate(f"{url}?options=-csearch_path%3D{schema}", processes, n)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--per-process", type=int, default=2000, help="records each process logs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--postgres", default=os.environ.get("WALBUF_TEST_POSTGRES"))
    args = parser.parse_args()
    if not args.postgres:
        sys.exit("no PostgreSQL: pass --postgres URL, or run under scripts/with-postgres")

    print(f"{'writers':>7}  {'SQLite rec/s':>13}  {'PostgreSQL rec/s':>16}  PostgreSQL/SQLite")
    with tempfile.TemporaryDirectory() as tmp:
        for processes in args.processes:
            lite, pg = [], []
            for _ in range(args.rounds):
                lite.append(sqlite_round(Path(tmp), processes, args.per_process))
                pg.append(postgres_round(args.postgres, processes, args.per_process))
            a, b = statistics.median(lite), statistics.median(pg)
            print(f"{processes:>7}  {a:>13,.0f}  {b:>16,.0f}  {b / a:.2f}x")
    print(f"(median of {args.rounds} alternating rounds, {args.per_process} records per writer; no record lost)")


if __name__ == "__main__":
    main()
