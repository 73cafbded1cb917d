"""Benchmark of `walbuf sync`, measured side by side in one run and printed as ratios.

1. Rows/s of walbuf's sync against a bare loop of wandb.log of the same rows
   (same keys, same define_metric calls, same shared-mode settings) into the
   same local fake W&B server (tests/wandb_server.py), run in a process of
   its own, as W&B is never in the syncer's process. The sync declares one
   glob per writer (``rank-0/*`` against ``rank-0/step``: walbuf.syncer.metrics),
   and so does the bare loop; with --each-key, a second bare loop declaring
   each key instead, as a hand-written script might, is measured too.
   Rounds alternate. The writers stay open, as while a job trains: the one
   upload that finishes the W&B run once every writer has closed (see
   README, run state) is measured on its own, against the bare loop's time.
2. A sync of 1,000 new records on a buffer that already holds --big synced
   ones, against the same sync on a fresh buffer. (The big buffer's records
   are marked synced by setting the cursors in SQL: uploading them first
   would measure nothing more.)
3. Peak RSS of the process running a sync of --big pending records, and of
   the wandb-core process under it.

    python scripts/bench_sync.py [--rows 20000] [--rounds 24] [--big 1000000] [--each-key] [--no-pin]

The figure to quote is the median of the rounds' ratios, printed with a
95% interval for it (order statistics: no assumption about the noise's
shape). By default this process runs on one CPU and wandb-core (with the
fake server) on another, as on a login node with cores to spare, where the
syncer and wandb-core do not take turns on one: on a 2-core VM, where the
scheduler puts them changes a round's time by up to 2x, and the median's
interval was 2.5x to 3x wider with --no-pin (docs/performance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import walbuf  # noqa: E402
from walbuf import Target, sync  # noqa: E402
from walbuf.syncer.wandb import WandbRun  # noqa: E402

TESTS = Path(__file__).resolve().parent.parent / "tests"

WRITERS = ("rank-0", "rank-1")


def fill(buffer: Path, n: int, run: str = "bench", *, close: bool = True) -> list[walbuf.Writer]:
    """n records, alternating between the writers, as training would log them; the writers, open unless ``close``."""
    writers = [walbuf.Writer(buffer, writer=w, run=run) for w in WRITERS]
    for i in range(n):
        writers[i % 2].log({"train/loss": 1.0 / (i + 1), "train/acc": i / n, "lr": 3e-4})
    if close:
        for w in writers:
            w.close()
    return writers


def rows_as_sync_sends_them(buffer: Path) -> list[dict[str, object]]:
    rows = []
    for r in walbuf.read(buffer):
        row: dict[str, object] = {f"{r.writer}/{k}": v for k, v in r.metrics.items()}
        row[f"{r.writer}/step"] = r.step
        row["_timestamp"] = r.time
        rows.append(row)
    return rows


def time_walbuf_sync(buffer: Path, writers: list[walbuf.Writer], n: int) -> tuple[float, float]:
    """(the sync of n records while the writers are open, the sync that then finishes the run)."""
    start = time.perf_counter()
    result = sync(buffer, project="bench", entity="bench")
    elapsed = time.perf_counter() - start
    assert result.records == n and result.runs[0].finished is None, result
    for w in writers:
        w.close()
    start = time.perf_counter()
    result = sync(buffer)
    finishing = time.perf_counter() - start
    assert result.runs[0].finished == 0, result
    return elapsed, finishing


def time_bare_wandb(directory: Path, rows: list[dict[str, object]], run_id: str, *, per_key: bool = False) -> float:
    start = time.perf_counter()
    run = WandbRun(Target(run_id, "bench", "bench"), "bare", "online", directory)
    for writer in WRITERS:
        if per_key:
            for key in ("train/loss", "train/acc", "lr"):
                run.define_metric(f"{writer}/{key}", f"{writer}/step")
        else:
            run.define_metric(f"{writer}/*", f"{writer}/step")
    for row in rows:
        run.log(row)
    run.finish()
    return time.perf_counter() - start


def incremental(directory: Path, big: int, new: int) -> tuple[float, float]:
    large = directory / "large.db"
    fill(large, big, run="inc")
    with sqlite3.connect(large) as conn:
        conn.execute("UPDATE writers SET synced_id = (SELECT max(id) FROM records)")
    fresh = directory / "fresh.db"
    times: dict[Path, list[float]] = {large: [], fresh: []}
    for round_ in range(3):
        for buffer in (large, fresh):
            with walbuf.Writer(buffer, writer="rank-0", run="inc") as w:
                for i in range(new):
                    w.log({"train/loss": float(i), "round": round_})
            start = time.perf_counter()
            result = sync(buffer, project="bench", entity="bench")
            times[buffer].append(time.perf_counter() - start)
            assert result.records == new, result
    return statistics.median(times[large]), statistics.median(times[fresh])


# VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork and exec, so a
# child of this (large) benchmark process would report the parent's size.
# wandb-core's figure (ru_maxrss of the syncer's children) is an upper bound.
MEASURE_RSS = """
import re, resource, sys
from walbuf import sync
result = sync(sys.argv[1], project="bench", entity="bench")
hwm = re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)
print(result.records, hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_rss(directory: Path, big: int) -> tuple[int, int, int, float]:
    buffer = directory / "pending.db"
    fill(buffer, big, run="rss")
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", MEASURE_RSS, str(buffer)], capture_output=True, text=True, check=True, env=os.environ
    ).stdout.split()
    records, own_kib, core_kib = (int(x) for x in out[-3:])
    return records, own_kib, core_kib, time.perf_counter() - start


# The fake server in a process of its own: in the benchmark's process its
# threads would contend with the measured client for the GIL.
SERVE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from wandb_server import FakeWandb
with FakeWandb() as server:
    print(json.dumps(server.env()), flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def fake_server() -> Iterator[tuple[dict[str, str], int]]:
    """The environment for wandb to talk to a fake W&B server that runs while in the block, and its process id."""
    with subprocess.Popen(
        [sys.executable, "-c", SERVE, str(TESTS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as server:
        assert server.stdout is not None and server.stdin is not None
        try:
            yield json.loads(server.stdout.readline()), server.pid
        finally:
            server.stdin.close()


def pin(server: int) -> None:
    """This process (its every thread) on one CPU; wandb-core and the fake server on another (Linux).

    Both kinds of upload run under the same placement.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("pinning needs 2 CPUs: run with --no-pin")
    core = [
        int(pid)
        for pid in os.listdir("/proc")
        if pid.isdigit() and _parent(int(pid)) == os.getpid() and _name(int(pid)) == "wandb-core"
    ]
    if len(core) != 1:
        raise SystemExit(
            f"pinning: expected one wandb-core process under this one, found {len(core)}; run with --no-pin"
        )
    for pid, cpu in ((os.getpid(), cpus[0]), (core[0], cpus[1]), (server, cpus[1])):
        for task in os.listdir(f"/proc/{pid}/task"):  # every thread: affinity is per thread
            os.sched_setaffinity(int(task), {cpu})


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def median_interval(ordered: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``ordered`` (sorted): order statistics at binomial ranks."""
    n = len(ordered)
    k = 0  # the largest k with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2
    while k < n // 2 and sum(math.comb(n, i) for i in range(k + 1)) / 2**n <= (1 - confidence) / 2:
        k += 1
    return ordered[max(k - 1, 0)], ordered[n - max(k, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--big", type=int, default=1_000_000)
    parser.add_argument("--new", type=int, default=1_000)
    parser.add_argument(
        "--each-key",
        action="store_true",
        help="also a bare loop declaring each key, not one glob per writer (a third kind in every round)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="this process on one CPU, wandb-core and the fake server on another (default; Linux)",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, fake_server() as (server_env, server_pid):
        directory = Path(tmp)
        os.environ.update(server_env)
        os.environ["WANDB_DIR"] = tmp

        reference = directory / "reference.db"
        fill(reference, args.rows)
        rows = rows_as_sync_sends_them(reference)
        time_bare_wandb(directory, rows[:100], "warmup")  # wandb's service process starts once
        if args.pin:
            pin(server_pid)
        # Every round's buffer is filled first, and written out: the work of
        # filling one (and the kernel's writing it back) falls on no round.
        buffers = [directory / f"sync-{r}.db" for r in range(args.rounds)]
        open_writers = [fill(buffer, args.rows, close=False) for buffer in buffers]
        os.sync()
        # The benchmark's own objects (the bare loop's rows above all) are left
        # out of the garbage collector's passes: a `walbuf sync` process holds
        # no such heap, and every full pass of the sync's would walk it.
        gc.freeze()
        kinds = ["sync", "bare"] + (["each key"] if args.each_key else [])
        seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
        finishing = []
        for r, (buffer, writers) in enumerate(zip(buffers, open_writers, strict=False)):
            # Each round runs the kinds in another order: a run's after-effects
            # (wandb-core closing the run before, the page cache) fall on each alike.
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                if kind == "sync":
                    sending, finished = time_walbuf_sync(buffer, writers, args.rows)
                    seconds[kind].append(sending)
                    finishing.append(finished)
                else:
                    seconds[kind].append(
                        time_bare_wandb(directory, rows, f"{kind[0]}{r:04d}", per_key=kind == "each key")
                    )
        print(
            "placement               :",
            "pinned (this process on one CPU, wandb-core on the other)" if args.pin else "the scheduler's",
        )
        print(
            f"walbuf sync             : {args.rows / statistics.median(seconds['sync']):8,.0f} rows/s"
            f" (median of {args.rounds})"
        )
        print(
            f"bare wandb.log loop     : {args.rows / statistics.median(seconds['bare']):8,.0f} rows/s"
            " (the same glob definitions)"
        )
        # Each round's ratio, then their median: a slow patch of the machine
        # falls on one round's measurements, not on one kind's.
        for kind, label in (("bare", "sync / bare            "), ("each key", "sync / bare, each key  ")):
            if kind in seconds:
                ratio = sorted(b / o for b, o in zip(seconds[kind], seconds["sync"], strict=False))
                low, high = median_interval(ratio)
                print(
                    f"{label} : {statistics.median(ratio):5.2f}x"
                    f"   (95% interval of the median {low:.2f}x to {high:.2f}x;"
                    f" rounds {ratio[0]:.2f}x to {ratio[-1]:.2f}x)" + ("  target >= 0.9x" if kind == "bare" else "")
                )
        print(
            "finishing the run, once per job:"
            f" {statistics.median(finishing) / statistics.median(seconds['bare']):5.2f}x"
            f" the bare loop's time for {args.rows:,} rows"
        )

        large_s, fresh_s = incremental(directory, args.big, args.new)
        print(
            f"{args.new:,} new on {args.big:,} synced : {large_s / fresh_s:5.2f}x the time on a fresh buffer"
            " (target <= 2x)"
        )
        records, own_kib, core_kib, seconds = peak_rss(directory, args.big)
        print(
            f"sync of {records:,} pending : peak RSS {own_kib / 1024:,.0f} MB (syncer),"
            f" {core_kib / 1024:,.0f} MB (wandb-core)  (target <= 300 MB), {seconds:,.0f} s"
        )


if __name__ == "__main__":
    main()
