"""What a `walbuf sync --follow` costs the W&B server: requests per pass that uploads, and per day.

A writer logs one record, the follow uploads it, and so on for --passes
passes, against the fake server (tests/wandb_server.py), which records every
request it gets; then the writer closes and the follow finishes the run.
Printed: requests per uploading pass by kind (GraphQL operations,
file_stream posts, file PUTs), the finishing pass's, and what a day of
uploading passes at the default interval (a record arriving at least every
5 s) sends, against W&B's documented limit of 2 file_stream requests per
second per run (Dedicated/Self-Managed) and the older public 50-200
requests per minute per account.

    python scripts/bench_follow_requests.py [--passes 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import walbuf
from walbuf.syncer.follow import DEFAULT_INTERVAL

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from wandb_server import FakeWandb  # noqa: E402


def kind(request: tuple[str, str, str | None]) -> str:
    method, path, operation = request
    if operation:
        return f"graphql {operation}"
    return "file_stream" if path.endswith("file_stream") else f"{method} file"


def rows(server: FakeWandb) -> int:
    return sum(len(run.history) for run in list(server.runs.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, FakeWandb() as server:
        buffer = Path(tmp) / "metrics.db"
        writer = walbuf.Writer(buffer, writer="w", run="follow")
        writer.log({"x": 0})
        follow = subprocess.Popen(
            [sys.executable, "-m", "walbuf", "sync", str(buffer), "--follow", "--interval", "0.2", "--quiet"],
            env={**os.environ, **server.env()},
        )
        while rows(server) < 1:  # a bench may poll: the first pass has run
            time.sleep(0.05)
        start = len(server.requests)
        for i in range(1, args.passes + 1):
            writer.log({"x": i})
            while rows(server) < i + 1:
                time.sleep(0.05)
        during = Counter(kind(r) for r in server.requests[start:])
        end = len(server.requests)
        writer.close()
        if follow.wait(timeout=300) != 0:
            sys.exit("the follow failed")
        finishing = Counter(kind(r) for r in server.requests[end:])
    per_pass = {k: n / args.passes for k, n in sorted(during.items())}
    total = sum(per_pass.values())
    day = 86_400 / DEFAULT_INTERVAL
    print(f"requests per uploading pass (mean of {args.passes}): {total:.1f}")
    for k, n in per_pass.items():
        print(f"  {k:<40} {n:5.1f}")
    print(
        f"the finishing pass: {sum(finishing.values())} ({', '.join(f'{k} {n}' for k, n in sorted(finishing.items()))})"
    )
    stream = per_pass.get("file_stream", 0.0)
    print(
        f"a day of uploading passes every {DEFAULT_INTERVAL:g} s: {total * day:,.0f} requests"
        f" ({total * 60 / DEFAULT_INTERVAL:.0f} a minute), {stream * day:,.0f} of them file_stream"
        f" ({stream / DEFAULT_INTERVAL:.2f}/s against a limit of 2/s per run)"
    )


if __name__ == "__main__":
    main()
