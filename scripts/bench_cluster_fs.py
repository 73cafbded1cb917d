"""The cluster workload on two mounts of one folder (tests/fsbed.py), and log()'s cost there: issue 33's table.

For each bed (locks per mount, locks spanning, spanning with 30 s kernel
caches and syncs alternating hosts, sshfs): 4 writer processes on each of
hosts A and B log --records records each into one directory buffer, shards
rotating every 2 s; one writer per host is killed -9 halfway; `walbuf sync`
loops on host A meanwhile (on the cache bed, syncs alternate between A and
B). Host B's processes run in a PID namespace of their own (another
machine, to a sync on A). Then syncs on A run until one sends nothing, and
what the W&B fake holds is compared with what each writer had acknowledged
(a step is acknowledged once log() returned for it): arrived once,
duplicates, missing.

log()'s cost: one process logging --cost-records records on host A's
mount, against a bare sqlite3 INSERT committed per record into a WAL-mode
file on the same mount (rollback journal on direct_io, where WAL cannot map
its index), in alternating rounds; the ratio of the medians.

    python scripts/bench_cluster_fs.py [--records 20000] [--pause 0.001] [--beds passfs-local,passfs-cache,...]

Needs root, /dev/fuse, libfuse2, fuse3, sshfs and openssh-server (.ci/run
installs them). Not part of the suite: it takes minutes.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import fsbed  # noqa: E402
from wandb_server import FakeWandb  # noqa: E402

import walbuf  # noqa: E402

WRITER = """
import sys, time, walbuf
w = walbuf.Writer(sys.argv[1], writer=sys.argv[2], run="work")
for i in range(int(sys.argv[3])):
    w.log({"i": i})
    print(i, flush=True)
    time.sleep(float(sys.argv[4]))  # a training step's worth of time: syncs run while the job logs
w.close()
"""


class Writer:
    """A writer process; what it acknowledged, read from its output as it goes."""

    def __init__(self, buffer: str, name: str, host: str, n: int, pause: float, *, other_machine: bool) -> None:
        prefix = fsbed.ON_B if other_machine else []
        env = {**os.environ, "WALBUF_HOST": host, "WALBUF_ROTATE_SECONDS": "2"}
        self.name = name
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", WRITER, buffer, name, str(n), str(pause)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.acked = -1
        self.halfway = threading.Event()
        self.half = n // 2
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.acked = int(line)
            if self.acked >= self.half:
                self.halfway.set()
        self.halfway.set()

    def kill_halfway(self) -> None:
        self.halfway.wait()
        self.proc.kill()


def sync(server: FakeWandb, buffer: str, host: str, *, other_machine: bool) -> int:
    prefix = fsbed.ON_B if other_machine else []
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "walbuf", "sync", buffer, "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, **server.env(), "WALBUF_HOST": host},
    )
    return proc.returncode


def workload(kind: str, records: int, pause: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as base, fsbed.mounted(Path(base), kind) as bed, FakeWandb() as server:
        a, b = str(bed.a / "buf") + "/", str(bed.b / "buf") + "/"
        writers = [Writer(a, f"a{i}", "hostA", records, pause, other_machine=False) for i in range(4)]
        writers += [Writer(b, f"b{i}", "hostB", records, pause, other_machine=True) for i in range(4)]
        killers = [threading.Thread(target=w.kill_halfway) for w in (writers[0], writers[4])]
        for killer in killers:
            killer.start()
        codes: dict[int, int] = {}
        turn = 0
        while any(w.proc.poll() is None for w in writers):
            on_b = kind == "passfs-cache" and turn % 2 == 1
            code = sync(server, b if on_b else a, "hostB" if on_b else "hostA", other_machine=on_b)
            codes[code] = codes.get(code, 0) + 1
            turn += 1
        for killer in killers:
            killer.join()
        for w in writers:
            w.proc.wait()
            w.reader.join()
        before = -1
        while True:  # until a sync on A brings nothing more
            code = sync(server, a, "hostA", other_machine=False)
            codes[code] = codes.get(code, 0) + 1
            arrived = sum(len(run.history) for run in server.runs.values())
            if arrived == before:
                break
            before = arrived
        failed = [w.name for w in writers if w.proc.returncode not in (0, -9)]
        acked = arrived_once = duplicates = missing = 0
        (fake_run,) = server.runs.values()
        for w in writers:
            steps = [row[f"{w.name}/i"] for row in fake_run.history if f"{w.name}/i" in row]
            acked += w.acked + 1
            arrived_once += len(set(steps) & set(range(w.acked + 1)))
            duplicates += len(steps) - len(set(steps))
            missing += len(set(range(w.acked + 1)) - set(steps))
        return {
            "acknowledged": acked,
            "arrived once": arrived_once,
            "duplicates": duplicates,
            "missing": missing,
            "sync exit codes": codes,
            "writers that failed": failed,
        }


def log_cost(folder: Path, records: int, rounds: int, journal: str = "WAL") -> tuple[float, float]:
    """Median µs per record in ``folder``: walbuf's log(), and a bare sqlite3 INSERT committed per record."""
    ours, bare = [], []
    for r in range(rounds):
        w = walbuf.Writer(str(folder / f"buf{r}") + "/", writer="w", run="cost")
        start = time.perf_counter()
        for i in range(records):
            w.log({"loss": 0.5, "i": i})
        ours.append((time.perf_counter() - start) / records * 1e6)
        w.close()
        conn = sqlite3.connect(folder / f"bare{r}.db", isolation_level=None)
        conn.execute(f"PRAGMA journal_mode={journal}")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE records (id INTEGER PRIMARY KEY, step INTEGER, time REAL, metrics TEXT)")
        start = time.perf_counter()
        for i in range(records):
            conn.execute("INSERT INTO records (step, time, metrics) VALUES (?, ?, ?)", (i, time.time(), '{"i":1}'))
        bare.append((time.perf_counter() - start) / records * 1e6)
        conn.close()
    return statistics.median(ours), statistics.median(bare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--beds", default="passfs-local,passfs-span,passfs-cache,sshfs")
    parser.add_argument("--cost-records", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pause", type=float, default=0.001, help="seconds a writer waits between records")
    parser.add_argument("--no-workload", action="store_true")
    args = parser.parse_args()
    why = fsbed.missing()
    if why is not None:
        sys.exit(f"bench_cluster_fs: {why}")
    os.environ.setdefault("WANDB_SILENT", "true")
    for kind in args.beds.split(","):
        if not args.no_workload:
            print(kind, workload(kind, args.records, args.pause), flush=True)
        with tempfile.TemporaryDirectory() as base, fsbed.mounted(Path(base), kind) as bed:
            journal = "DELETE" if kind == "passfs-direct" else "WAL"  # WAL cannot map its index on direct_io
            ours, bare = log_cost(bed.a, args.cost_records, args.rounds, journal)
        print(f"{kind}: log() {ours:.1f} µs, bare sqlite3 INSERT {bare:.1f} µs: {ours / bare:.2f}x", flush=True)
    with tempfile.TemporaryDirectory() as base:
        ours, bare = log_cost(Path(base), args.cost_records, args.rounds)
    print(f"local disk: log() {ours:.1f} µs, bare sqlite3 INSERT {bare:.1f} µs: {ours / bare:.2f}x", flush=True)


if __name__ == "__main__":
    main()
