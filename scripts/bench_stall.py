"""How long a writer's log() waits while `walbuf prune` removes synced records.

A SQLite buffer is filled with --records synced records (200 bytes of text
and a number each, as tests/test_prune.py logs them); then a writer process
logs one record every 5 ms while this process prunes them all, and prints
the writer's log() durations (worst, p99.9, p99, median) and the prune's own
time. A whole VACUUM or one long delete shows as a worst log() as long as
itself.

    python scripts/bench_prune.py [--records 300000] [--batch 1000]

--batch sets prune_module.PRUNE_BATCH for this run (records per
transaction).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import walbuf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from wandb_server import FakeWandb  # noqa: E402

prune_module = importlib.import_module("walbuf.ops.prune")  # walbuf.ops.prune is also the function

WRITER = """
import select, sys, time, walbuf
times = []
with walbuf.Writer(sys.argv[1], writer="live", run="r") as w:
    w.log({"i": -1})
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:  # until told to stop
        start = time.perf_counter()
        w.log({"i": len(times)})
        times.append(time.perf_counter() - start)
        time.sleep(0.005)
print(" ".join(f"{t:.6f}" for t in times), flush=True)
"""


def fill(buffer: Path, records: int, synced: bool) -> None:
    with walbuf.Writer(buffer, writer="old", run="r") as w:
        for i in range(records):
            w.log({"payload": "x" * 200, "i": i})
    if synced:
        with sqlite3.connect(buffer, isolation_level=None) as conn:
            # What a confirmed sync leaves behind: every record of "old" synced.
            conn.execute("UPDATE writers SET synced_id = (SELECT max(id) FROM records) WHERE name = 'old'")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--during", choices=["prune", "sync"], default="prune")
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--batch", type=int, default=prune_module.PRUNE_BATCH)
    parser.add_argument("--no-vacuum", action="store_true", help="delete only; give no space back")
    args = parser.parse_args()
    prune_module.PRUNE_BATCH = args.batch
    with tempfile.TemporaryDirectory() as tmp:
        buffer = Path(tmp) / "metrics.db"
        started = time.perf_counter()
        fill(buffer, args.records, synced=args.during == "prune")
        size = buffer.stat().st_size
        print(f"filled {args.records} records ({size / 2**20:.0f} MiB) in {time.perf_counter() - started:.0f} s")
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(buffer)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline() == "ready\n"
        started = time.perf_counter()
        if args.during == "prune":
            result = walbuf.prune(buffer, older_than=0, vacuum=not args.no_vacuum)
            what = (
                f"prune: {result.deleted} records in {time.perf_counter() - started:.1f} s,"
                f" {result.bytes_before / 2**20:.1f} -> {result.bytes_after / 2**20:.1f} MiB (batch {args.batch})"
            )
        else:
            with FakeWandb() as server:
                proc = subprocess.run(
                    [sys.executable, "-m", "walbuf", "sync", str(buffer), "--project", "bench", "--quiet"],
                    env={**os.environ, **server.env()},
                    capture_output=True,
                    text=True,
                )
            what = f"sync: exit {proc.returncode} in {time.perf_counter() - started:.1f} s {proc.stderr.strip()}"
        writer.stdin.write("stop\n")
        writer.stdin.flush()
        times = sorted(float(t) for t in writer.stdout.readline().split())
        writer.wait()

    def at(q: float) -> float:  # nearest rank
        return times[min(len(times) - 1, int(q * len(times)))]

    print(what)
    print(
        f"writer log() during it ({len(times)} calls): worst {times[-1] * 1000:.1f} ms,"
        f" p99.9 {at(0.999) * 1000:.1f} ms, p99 {at(0.99) * 1000:.2f} ms,"
        f" median {statistics.median(times) * 1000:.2f} ms"
    )


if __name__ == "__main__":
    main()
