"""More writer processes than the PostgreSQL server has connections: how many records land.

--processes writer processes start at once, each opens a writer of its own,
logs --per-process records (one every 10 ms, as a training loop would) and
closes. Prints, per process count, the records that landed in the buffer,
the processes that failed (and the first error), and the time taken. With
--fresh the buffer is a new, empty schema that the writers make together
(a DDP job's first start): one of them creates the tables while the rest
wait; without it, a writer made the schema before the clock starts.

    WALBUF_PG_MAX_CONNECTIONS=40 scripts/with-postgres python scripts/bench_pg_connections.py [--processes N] [--fresh]

The PostgreSQL URL comes from WALBUF_TEST_POSTGRES (scripts/with-postgres
sets it; WALBUF_PG_MAX_CONNECTIONS sets the throwaway server's limit).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid

import sqlalchemy as sa

import walbuf

WRITER = """
import sys, time, walbuf
with walbuf.Writer(sys.argv[1], writer=sys.argv[2], run="bench") as w:
    for i in range(int(sys.argv[3])):
        w.log({"i": i})
        time.sleep(0.01)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, nargs="+", default=[100, 300])
    parser.add_argument("--per-process", type=int, default=50)
    parser.add_argument("--fresh", action="store_true", help="the writers make the buffer's schema together")
    args = parser.parse_args()
    postgres = os.environ["WALBUF_TEST_POSTGRES"]
    admin = sa.create_engine(postgres, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        limit = conn.exec_driver_sql("SHOW max_connections").scalar()
    for processes in args.processes:
        schema = f"bench_{uuid.uuid4().hex[:12]}"
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
        buffer = f"{postgres}?options=-csearch_path%3D{schema}"
        if not args.fresh:
            walbuf.Writer(buffer, writer="setup", run="bench").close()  # the schema made before the clock
        started = time.perf_counter()
        jobs = [
            subprocess.Popen(
                [sys.executable, "-c", WRITER, buffer, f"proc-{i}", str(args.per_process)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(processes)
        ]
        errors = [job.communicate()[1] for job in jobs]
        took = time.perf_counter() - started
        failed = [e for job, e in zip(jobs, errors, strict=False) if job.returncode != 0]
        landed = sum(1 for r in walbuf.read(buffer, run="bench") if r.writer != "setup")
        first = failed[0].strip().splitlines()[-1] if failed else ""
        print(
            f"{processes} writer processes{' on a new schema' if args.fresh else ''}, server max_connections={limit}:"
            f" {landed} of"
            f" {processes * args.per_process} records landed, {len(failed)} processes failed, {took:.0f} s"
            + (f"; first error: {first}" if first else "")
        )
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")


if __name__ == "__main__":
    main()
