"""Faults: a full disk, the wall clock going backwards, many writers at once."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import workers
from conftest import by_writer

import walbuf

pytestmark = pytest.mark.backends("sqlite", "postgresql")


@pytest.mark.backends("sqlite")
def test_full_disk_is_a_clear_error_and_loses_nothing_committed(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"i": -1})
        conn = w._open.segment.appender._cursor.connection  # a tiny disk: SQLite may not grow the file past this
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count={pages + 20}")
        acknowledged = []
        with pytest.raises(walbuf.BufferFullError, match="disk is full"):
            for i in range(10_000):
                w.log({"i": i, "payload": "x" * 500})
                acknowledged.append(i)
        assert acknowledged  # some fit before the disk filled up
        conn.execute("PRAGMA max_page_count=1073741823")  # space freed
        w.log({"i": "after"})
    stored = [r.metrics["i"] for r in walbuf.read(buffer)]
    assert stored == [-1, *acknowledged, "after"]


def test_wall_clock_going_backwards_changes_no_order(buffer, monkeypatch):
    readings = iter([1000.0, 2000.0, 500.0, 1500.0])

    class Clock:  # what log() reads as the wall-clock time
        time = staticmethod(lambda: next(readings))

    monkeypatch.setattr(walbuf.writer, "time", Clock)
    with walbuf.Writer(buffer, writer="w") as w:
        for i in range(4):
            w.log({"i": i})
    records = list(walbuf.read(buffer))
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert [r.time for r in records] == [1000.0, 2000.0, 500.0, 1500.0]


@pytest.mark.slow
def test_64_concurrent_writers_lose_nothing(buffer):
    ctx = mp.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=workers.concurrent_writer, args=(str(buffer), i, 100, go)) for i in range(64)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * 64
    groups = by_writer(buffer, run="many")
    assert len(groups) == 64
    assert all([r.step for r in records] == list(range(100)) for records in groups.values())
