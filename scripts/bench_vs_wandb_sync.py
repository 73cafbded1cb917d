"""`walbuf sync` against `wandb beta sync` and `wandb sync` of the same rows, side by side, into the fake server.

The rows: --rows records of 5 keys from one writer, logged into a walbuf
buffer, and the same rows logged by wandb in offline mode (under the prefix
and step axis walbuf gives them, with the same glob definition). Each round
runs, in a rotated order and each as its own process (imports included):

- first sync: `walbuf sync` of the buffer, the same under cron's time
  bound (`--max-seconds 540`, as `walbuf-cron` runs it), `wandb beta sync`
  and `wandb sync` of the offline run directory;
- incremental: --more new records on top of the synced ones, against
  wandb's tools uploading an offline run of --more rows.

The walbuf writer stays open throughout, as a job still running when cron
syncs (so a sync ends by marking the run preempting; a sync after the
writer closed would also finish the run, with a second, empty upload).
Before each walbuf contender the buffer's cursors are set back, so each
first sync sends every row again (into a new W&B run) and each incremental
one the round's new rows. Printed: each contender's median
time and rows/s, and walbuf's time over each of the others (median of the
rounds' ratios).

    python scripts/bench_vs_wandb_sync.py [--rows 20000] [--more 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import glob
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

OFFLINE = """
import sys, wandb
rows, folder = int(sys.argv[1]), sys.argv[2]
run = wandb.init(mode="offline", project="bench", dir=folder,
                 settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
run.define_metric("w/*", step_metric="w/step")
for i in range(rows):
    run.log({"w/step": i, "w/a": i * 0.5, "w/b": 1.0, "w/c": 2.0, "w/d": 3.0, "w/e": 4.0})
run.finish()
"""


def log(writer: walbuf.Writer, start: int, n: int) -> None:
    for i in range(start, start + n):
        writer.log({"a": i * 0.5, "b": 1.0, "c": 2.0, "d": 3.0, "e": 4.0})


def offline_run(folder: Path, rows: int) -> str:
    folder.mkdir()
    subprocess.run([sys.executable, "-c", OFFLINE, str(rows), str(folder)], check=True, capture_output=True)
    return glob.glob(str(folder / "wandb" / "offline-run-*"))[0]


def pending_again(buffer: Path, synced: int) -> None:
    """The records after ``synced`` pending again; every record (0): for a new W&B run."""
    with sqlite3.connect(buffer) as conn:
        conn.execute("UPDATE writers SET synced_id = ?", (synced,))
        if synced == 0:
            conn.execute("UPDATE runs SET wandb_id = NULL, finished_exit = NULL")


def timed(command: list[str], env: dict[str, str], cleanup: str | None = None) -> float:
    if cleanup:
        for marker in glob.glob(cleanup + "/*.synced"):  # so wandb's tools upload it again
            os.remove(marker)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command)} failed: {proc.stderr.strip()}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--more", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    wandb_cli = str(Path(sys.executable).with_name("wandb"))
    with tempfile.TemporaryDirectory() as tmp, FakeWandb() as server:
        env = {**os.environ, **server.env()}
        buffer = Path(tmp) / "metrics.db"
        writer = walbuf.Writer(buffer, writer="w", run="bench")
        log(writer, 0, args.rows)
        first_dir = offline_run(Path(tmp) / "first", args.rows)
        more_dir = offline_run(Path(tmp) / "more", args.more)
        walbuf_sync = [sys.executable, "-m", "walbuf", "sync", str(buffer), "--project", "bench", "--quiet"]
        cron_sync = [*walbuf_sync, "--max-seconds", "540"]
        times: dict[str, list[float]] = {}
        for r in range(args.rounds):
            firsts = {
                "walbuf sync": lambda: pending_again(buffer, 0) or timed(walbuf_sync, env),
                "walbuf (cron)": lambda: pending_again(buffer, 0) or timed(cron_sync, env),
                "wandb beta sync": lambda: timed([wandb_cli, "beta", "sync", first_dir], env, first_dir),
                "wandb sync": lambda: timed([wandb_cli, "sync", first_dir], env, first_dir),
            }
            order = list(firsts)[r % len(firsts) :] + list(firsts)[: r % len(firsts)]
            for name in order:
                times.setdefault(f"first: {name}", []).append(firsts[name]())
            with sqlite3.connect(buffer) as conn:
                (synced,) = conn.execute("SELECT max(id) FROM records").fetchone()
            log(writer, args.rows + r * args.more, args.more)
            mores = {
                "walbuf sync": lambda synced=synced: pending_again(buffer, synced) or timed(walbuf_sync, env),
                "walbuf (cron)": lambda synced=synced: pending_again(buffer, synced) or timed(cron_sync, env),
                "wandb beta sync": lambda: timed([wandb_cli, "beta", "sync", more_dir], env, more_dir),
                "wandb sync": lambda: timed([wandb_cli, "sync", more_dir], env, more_dir),
            }
            for name in order:
                times.setdefault(f"incremental: {name}", []).append(mores[name]())
        writer.close()
    for phase, rows in (("first", args.rows), ("incremental", args.more)):
        print(f"{phase} sync of {rows:,} rows (median of {args.rounds} rounds):")
        for name in ("walbuf sync", "walbuf (cron)", "wandb beta sync", "wandb sync"):
            median = statistics.median(times[f"{phase}: {name}"])
            print(f"  {name:<16} {median:6.2f} s  {rows / median:8,.0f} rows/s")
        others = ("wandb beta sync", "wandb sync")
        for ours, theirs_all in (("walbuf sync", others), ("walbuf (cron)", ("walbuf sync", *others))):
            for theirs in theirs_all:
                pairs = zip(times[f"{phase}: {ours}"], times[f"{phase}: {theirs}"], strict=True)
                ratio = statistics.median(a / b for a, b in pairs)
                print(f"  {ours} takes {ratio:.2f}x the time of {theirs}")


if __name__ == "__main__":
    main()
