"""Make tests/data/upgrade-d02335a.tar.gz: a directory buffer as walbuf at d02335a left it, for the upgrade test.

Run it with that walbuf's code, from a checkout of this repository:

    git worktree add /tmp/wb-d02335a d02335a
    PYTHONPATH=/tmp/wb-d02335a:/tmp/wb-d02335a/tests python scripts/make_upgrade_fixture.py tests/data

The buffer holds what a user upgrading would have (tests/test_upgrade.py
syncs it with this walbuf):

- an older walbuf's SQLite shard, live on host ``old1`` (WAL, no process
  uses it any more), whose first 30 records a sync of d02335a on ``old1``
  took in while it was in use (the hub's ``shard_cursors``), and 20 more;
- an older walbuf's sealed SQLite shard of host ``old2``, not taken in;
- shards of frames: a sealed one of host ``n1`` (writers ``c`` and ``e``,
  closed, with config and summary) that the sync took in, and a live one of
  host ``n2`` (writer ``d``) whose process died, half taken in;
- the hub, at schema revision 0011, holding what that sync took in and sent.

``manifest.json`` beside it lists, per writer, the steps logged and the
steps that sync sent to W&B: the upgrade test checks that the rest arrive,
each once.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from wandb_server import FakeWandb

import walbuf
from walbuf.directory.layout import Layout
from walbuf.store import Storage, Target
from walbuf.store.sqlite import SQLiteBackend

RUN = "exp"


def older_shard(layout: Layout, host: str, writer: str, steps: range, *, sealed: bool) -> Path:
    """An older walbuf's SQLite shard of ``writer`` holding ``steps`` (WAL while live; sealed as that walbuf did)."""
    layout.make()
    gen = time.time_ns()
    path = layout.live(host) / f"{gen:020d}.db"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    with Storage(SQLiteBackend(path, locks=layout.locks, owner=layout.owner), access="create") as shard:
        pk, _ = shard.register_writer(RUN, writer, "step", writer, host, 1, Target(None, None, None))
        appender = shard.appender()
        for i in steps:
            appender.append((pk, i, time.time(), json.dumps({"i": i})))
        appender.close()
    Path(f"{path}.inuse").touch(mode=0o600)
    if not sealed:
        return path
    import sqlite3

    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    target = layout.sealed / f"{host}.{gen}.db"
    os.replace(path, target)
    return target


def append_older(path: Path, writer: str, steps: range) -> None:
    backend = SQLiteBackend(path, locks=Layout(path.parents[2]).locks, owner=Layout(path.parents[2]).owner)
    with Storage(backend, access="create") as shard:
        pk, _ = shard.register_writer(RUN, writer, "step", writer, "old1", 1, Target(None, None, None))
        appender = shard.appender()
        for i in steps:
            appender.append((pk, i, time.time(), json.dumps({"i": i})))
        appender.close()


def log(directory: str, host: str, writer: str, steps: range, **extra: dict[str, object]) -> None:
    os.environ["WALBUF_HOST"] = host
    with walbuf.Writer(directory, writer=writer, run=RUN) as w:
        for i in steps:
            w.log({"i": i}, step=i)
        if "config" in extra:
            w.config(extra["config"])
        if "summary" in extra:
            w.summary(extra["summary"])


def main() -> None:
    out = Path(sys.argv[1])
    work = Path(tempfile.mkdtemp())
    directory = str(work / "buf") + "/"
    layout = Layout(work / "buf")
    logged: dict[str, list[int]] = {}

    log(directory, "n1", "c", range(40))
    log(directory, "n1", "e", range(5), config={"lr": 0.1}, summary={"best": 0.9})
    logged["c"], logged["e"] = list(range(40)), list(range(5))

    live = older_shard(layout, "old1", "a", range(30), sealed=False)
    logged["a"] = list(range(50))

    # Writer d on n2, in a child that logs 30, lets the sync run, logs 30 more and dies without closing.
    ready, go = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:
        os.environ["WALBUF_HOST"] = "n2"
        w = walbuf.Writer(directory, writer="d", run=RUN)
        for i in range(30):
            w.log({"i": i}, step=i)
        os.write(ready[1], b"x")
        os.read(go[0], 1)
        for i in range(30, 60):
            w.log({"i": i}, step=i)
        os._exit(0)  # as kill -9: its shard stays live, with no close
    os.read(ready[0], 1)
    logged["d"] = list(range(60))

    with FakeWandb() as server:
        # A process of the older walbuf still uses old1's shard: the sync takes in a snapshot of it.
        inuse = os.open(f"{live}.inuse", os.O_RDONLY)
        fcntl.flock(inuse, fcntl.LOCK_SH)
        env = {**os.environ, **server.env(), "WALBUF_HOST": "old1", "WANDB_DIR": str(work)}
        proc = subprocess.run(
            [sys.executable, "-m", "walbuf", "sync", directory, "--quiet"], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        (fake_run,) = server.runs.values()
        sent: dict[str, list[int]] = {}
        for row in fake_run.history:
            for writer in logged:
                if f"{writer}/step" in row:
                    sent.setdefault(writer, []).append(row[f"{writer}/step"])
        append_older(live, "a", range(30, 50))
        os.close(inuse)
    os.write(go[1], b"x")
    os.waitpid(child, 0)

    older_shard(layout, "old2", "b", range(25), sealed=True)
    logged["b"] = list(range(25))

    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "upgrade-d02335a.tar.gz", "w:gz") as tar:
        tar.add(work / "buf", arcname="buf")
    manifest = {"logged": logged, "sent": sent, "run": RUN}
    (out / "upgrade-d02335a.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(json.dumps({w: len(s) for w, s in sent.items()}))


if __name__ == "__main__":
    main()
