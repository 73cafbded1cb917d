"""walbuf prune: synced and old records go, nothing unsynced ever does, the space comes back."""

from __future__ import annotations

import sqlite3

import pytest
from click.testing import CliRunner
from conftest import run_sql

import walbuf
from walbuf.cli import main
from walbuf.ops import parse_age, prune

pytestmark = pytest.mark.backends("sqlite", "postgresql")


def log(buffer, writer, n, start=0):
    with walbuf.Writer(buffer, writer=writer, run="r") as w:
        for i in range(n):
            w.log({"payload": "x" * 200, "i": start + i})


def mark_synced(buffer, writer, through_id):
    """What a confirmed sync leaves behind: the writer's cursor at ``through_id``."""
    run_sql(buffer, "UPDATE writers SET synced_id = :id WHERE name = :w", {"id": through_id, "w": writer})


def ids(buffer, writer=None):
    query = "SELECT r.id FROM records r JOIN writers w ON w.id = r.writer_id"
    if writer:
        return [row[0] for row in run_sql(buffer, query + " WHERE w.name = :w ORDER BY r.id", {"w": writer})]
    return [row[0] for row in run_sql(buffer, query + " ORDER BY r.id")]


def test_unsynced_records_are_never_deleted(buffer):
    log(buffer, "a", 10)
    mark_synced(buffer, "a", 4)
    assert prune(buffer, older_than=0).deleted == 4
    assert [r.metrics["i"] for r in walbuf.read(buffer)] == list(range(4, 10))


@pytest.mark.slow
def test_a_prune_of_many_batches_deletes_exactly_each_writers_synced_records(buffer):
    # Three writers' records interleaved, over several of prune's transactions
    # (PRUNE_BATCH each), each writer synced to another point.
    with (
        walbuf.Writer(buffer, writer="a", run="r") as a,
        walbuf.Writer(buffer, writer="b", run="r") as b,
        walbuf.Writer(buffer, writer="c", run="r") as c,
    ):
        for i in range(1200):
            for w in (a, b, c):
                w.log({"i": i})
    everything = {name: ids(buffer, name) for name in "abc"}
    cursors = {"a": everything["a"][-1], "b": everything["b"][700], "c": 0}
    for name, cursor in cursors.items():
        mark_synced(buffer, name, cursor)
    assert prune(buffer, older_than=0).deleted == 1200 + 701
    assert ids(buffer, "a") == []
    assert ids(buffer, "b") == everything["b"][701:]
    assert ids(buffer, "c") == everything["c"]
    with walbuf.Writer(buffer, writer="a", run="r") as a:
        assert a.log({"i": 0}) == 1200  # its steps go on after its pruned records


def test_young_records_are_kept_even_when_synced(buffer):
    log(buffer, "a", 5)
    mark_synced(buffer, "a", 5)
    assert prune(buffer, older_than=3600).deleted == 0
    assert len(ids(buffer)) == 5


def test_the_newest_record_is_kept_so_ids_keep_growing(buffer):
    log(buffer, "a", 5)
    mark_synced(buffer, "a", 5)
    prune(buffer, older_than=0)
    assert ids(buffer) == [5]
    log(buffer, "b", 1)
    assert ids(buffer, "b") == [6]  # above every cursor: the next sync sees it


def test_a_pruned_writer_continues_its_steps(buffer):
    log(buffer, "a", 5)
    log(buffer, "b", 1)
    mark_synced(buffer, "a", 5)
    prune(buffer, older_than=0)
    assert ids(buffer, "a") == []
    with walbuf.Writer(buffer, writer="a", run="r") as w:
        assert w.last_step == 4 and w.log({"i": 5}) == 5
    assert walbuf.status(buffer).runs[0].writers[0].last_step == 5


@pytest.mark.backends("sqlite")
def test_prune_gives_the_space_back_to_the_filesystem(buffer):
    log(buffer, "a", 3000)
    mark_synced(buffer, "a", 3000)
    result = prune(buffer, older_than=0)
    assert result.deleted == 2999
    assert result.bytes_after < result.bytes_before / 5


@pytest.mark.backends("postgresql")
@pytest.mark.slow
def test_prune_makes_the_space_reusable_so_the_size_follows_pending_data(buffer):
    log(buffer, "a", 3000)
    mark_synced(buffer, "a", 3000)
    first = prune(buffer, older_than=0)
    assert first.deleted == 2999
    for _ in range(3):  # history grows by 3x what the buffer ever holds at once
        log(buffer, "a", 3000, start=3000)
        mark_synced(buffer, "a", ids(buffer)[-1])
        prune(buffer, older_than=0)
    log(buffer, "a", 3000, start=3000)
    assert walbuf.open_buffer(buffer).size() < first.bytes_before * 1.5


def test_status_after_prune_counts_what_is_left(buffer):
    log(buffer, "a", 6)
    mark_synced(buffer, "a", 3)
    prune(buffer, older_than=0)
    (run,) = walbuf.status(buffer).runs
    assert (run.records, run.pending) == (3, 3)


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("2w", 1209600)])
def test_ages(text, seconds):
    assert parse_age(text) == seconds


def test_cli_prune_and_its_bad_age(buffer):
    log(buffer, "a", 3)
    mark_synced(buffer, "a", 2)
    result = CliRunner().invoke(main, ["prune", str(buffer), "--older-than", "0s"])
    assert result.exit_code == 0 and "deleted 2 synced records" in result.output
    bad = CliRunner().invoke(main, ["prune", str(buffer), "--older-than", "7x"])
    assert bad.exit_code == 2 and "like 7d" in bad.output
    missing = CliRunner().invoke(main, ["prune", str(buffer) + ".nope", "--older-than", "7d"])
    assert missing.exit_code == 66


@pytest.mark.parametrize("older_than", [-1, float("inf"), True, "7d"])
def test_an_age_that_is_not_seconds_is_refused_naming_it_and_nothing_is_deleted(buffer, older_than):
    log(buffer, "a", 3)
    mark_synced(buffer, "a", 2)
    with pytest.raises(walbuf.ConfigError, match="older_than must be a finite number of seconds >= 0"):
        prune(buffer, older_than=older_than)
    assert len(list(walbuf.read(buffer))) == 3


@pytest.mark.backends("sqlite")
def test_a_buffer_made_before_incremental_vacuum_is_switched_by_its_first_prune_and_shrinks(buffer):
    log(buffer, "a", 3000)
    conn = sqlite3.connect(buffer, isolation_level=None)
    conn.execute("PRAGMA auto_vacuum=NONE")  # as walbuf made buffers before it set INCREMENTAL
    conn.execute("VACUUM")
    conn.close()
    assert run_sql(buffer, "PRAGMA auto_vacuum") == [(0,)]
    mark_synced(buffer, "a", 3000)
    result = prune(buffer, older_than=0)
    assert result.bytes_after < result.bytes_before / 5
    assert run_sql(buffer, "PRAGMA auto_vacuum") == [(2,)]


@pytest.mark.backends("sqlite")
def test_a_new_sqlite_buffer_gives_space_back_a_step_at_a_time(buffer):
    log(buffer, "a", 1)
    assert run_sql(buffer, "PRAGMA auto_vacuum") == [(2,)]  # INCREMENTAL: prune never rewrites the whole file


@pytest.mark.backends("sqlite")
def test_prune_checkpoints_its_own_batches_so_the_wal_a_writer_would_copy_back_stays_short(buffer):
    # SQLite has the connection whose commit makes the WAL longer than
    # wal_autocheckpoint pages copy it back before its commit returns: left
    # to that, a writer's log() paid for what prune wrote (a stall of 234 ms
    # in scripts/bench_stall.py). The WAL file only grows, so its size after
    # a prune without reclaim is the longest the WAL got.
    log(buffer, "a", 20_000)  # 5 MiB of records
    mark_synced(buffer, "a", 20_000)
    other = sqlite3.connect(buffer)  # open meanwhile, as a writer is: the WAL outlives prune's connection
    try:
        other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert prune(buffer, older_than=0, vacuum=False).deleted == 19_999
        assert (buffer.parent / f"{buffer.name}-wal").stat().st_size < 2**20
    finally:
        other.close()
