"""What a `walbuf sync --follow` costs the W&B server per minute, and how soon a record arrives.

A writer logs --rate records a second for --minutes minutes while a follow
(at its default interval) streams them to the fake server
(tests/wandb_server.py), which records every request it gets; then the
writer closes and the follow finishes the run. Printed: requests per minute
by kind (GraphQL operations, file_stream posts, file PUTs) over the
writer's minutes, the finishing's requests, rows logged and arrived (each
once), and the lag from a record's log() to its arrival at the server
(p50, p90, max). W&B documents 2 file_stream requests per second per run
(Dedicated/Self-Managed) and, in older public docs, 50-200 requests per
minute per account.

    python scripts/bench_follow_requests.py [--minutes 10] [--rate 2] [--interval S]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import walbuf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from wandb_server import FakeWandb  # noqa: E402


def kind(request: tuple[str, str, str | None]) -> str:
    method, path, operation = request
    if operation:
        return f"graphql {operation}"
    return "file_stream" if path.endswith("file_stream") else f"{method} file"


def index(row: dict[str, object]) -> int:
    """The record's number, under the writer's prefix."""
    return next(int(v) for k, v in row.items() if k.split("/")[-1] == "i")  # type: ignore[call-overload]


def watch_arrivals(server: FakeWandb, arrived: dict[int, float], done: threading.Event) -> None:
    """Stamp each history row with the time it reached the server (woken by the server's own condition)."""
    seen = 0
    with server._changed:
        while not done.is_set():
            server._changed.wait(timeout=0.5)
            now = time.time()
            history = [row for run in server.runs.values() for row in run.history]
            for row in history[seen:]:
                arrived.setdefault(index(row), now)
            seen = len(history)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=2.0, help="records logged per second")
    parser.add_argument("--interval", type=float, help="the follow's --interval (default: its own)")
    args = parser.parse_args()
    logged: dict[int, float] = {}
    arrived: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp, FakeWandb() as server:
        buffer = Path(tmp) / "metrics.db"
        writer = walbuf.Writer(buffer, writer="w", run="follow")
        follow = subprocess.Popen(
            [sys.executable, "-m", "walbuf", "sync", str(buffer), "--follow", "--quiet"]
            + ([] if args.interval is None else ["--interval", str(args.interval)]),
            env={**os.environ, **server.env()},
        )
        done = threading.Event()
        watcher = threading.Thread(target=watch_arrivals, args=(server, arrived, done), daemon=True)
        watcher.start()
        start = time.monotonic()
        first = len(server.requests)
        i = 0
        while time.monotonic() - start < args.minutes * 60:
            logged[i] = time.time()
            writer.log({"i": i})
            i += 1
            time.sleep(max(0.0, start + i / args.rate - time.monotonic()))
        during = Counter(kind(r) for r in server.requests[first:])
        minutes = (time.monotonic() - start) / 60
        end = len(server.requests)
        writer.close()
        if follow.wait(timeout=300) != 0:
            sys.exit("the follow failed")
        finishing = Counter(kind(r) for r in server.requests[end:])
        done.set()
        watcher.join()
        history = [index(row) for run in server.runs.values() for row in run.history]
    lags = sorted(arrived[i] - logged[i] for i in logged if i in arrived)
    total = sum(during.values())
    twice = len(history) - len(set(history))
    print(f"{minutes:.1f} minutes, {len(logged):,} records logged, {len(set(history)):,} arrived, {twice} twice")
    print(f"requests per minute: {total / minutes:.1f}")
    for k, n in sorted(during.items()):
        print(f"  {k:<40} {n / minutes:6.1f}")
    print(f"the finishing: {sum(finishing.values())} ({', '.join(f'{k} {n}' for k, n in sorted(finishing.items()))})")
    print(
        f"lag from log() to the server: p50 {statistics.median(lags):.2f} s,"
        f" p90 {lags[int(len(lags) * 0.9)]:.2f} s, max {lags[-1]:.2f} s"
    )


if __name__ == "__main__":
    main()
