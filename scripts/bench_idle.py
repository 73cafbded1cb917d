"""Delay from a record logged on an idle host to its arrival in W&B, with syncs only on another host.

A writer on host "c" of a directory buffer logs one record and then stays
open, logging nothing. Syncs run only on host "login", every --cron
seconds, as cron would run them. Any host reads a live shard, so the record
arrives at the first sync after it was logged, whatever the rotation age.
Printed: each trial's delay, and the delay as a fraction of the bound
docs/directory-buffers.md states (the cron interval).

    python scripts/bench_idle.py [--rotate 5] [--cron 5] [--trials 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from wandb_server import FakeWandb  # noqa: E402

import walbuf  # noqa: E402
from walbuf.directory.layout import ENV_HOST, ENV_ROTATE  # noqa: E402


def arrived(server: FakeWandb, writer: str, value: int) -> bool:
    return any(row.get(f"{writer}/i") == value for run in server.runs.values() for row in run.history)


def trial(server: FakeWandb, buffer: str, writer: str, rotate: float, cron: float) -> float:
    os.environ[ENV_HOST], os.environ[ENV_ROTATE] = "c", str(rotate)
    w = walbuf.Writer(buffer, writer=writer, run="idle")
    logged = time.time()
    w.log({"i": 1})  # the writer's first record: its shard was made just now, the worst case
    sync_env = {**os.environ, **server.env(), ENV_HOST: "login"}
    try:
        next_sync = logged
        while True:
            time.sleep(max(0.0, next_sync - time.time()))  # cron's schedule
            next_sync += cron
            subprocess.run([sys.executable, "-m", "walbuf", "sync", buffer, "--quiet"], env=sync_env, check=True)
            if arrived(server, writer, 1):
                return time.time() - logged
    finally:
        w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rotate", type=float, default=5.0, help="rotation age, seconds")
    parser.add_argument("--cron", type=float, default=5.0, help="seconds between syncs on the login host")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    bound = args.cron
    with tempfile.TemporaryDirectory() as tmp, FakeWandb() as server:
        buffer = str(Path(tmp) / "buf") + "/"
        for n in range(args.trials):
            delay = trial(server, buffer, f"eval{n}", args.rotate, args.cron)
            print(
                f"trial {n}: logged on an idle host, in W&B after {delay:5.1f} s"
                f" = {delay / bound:.2f}x the bound (the cron interval, {args.cron:g} s; rotation {args.rotate:g} s)"
            )


if __name__ == "__main__":
    main()
