"""The Buffer protocol's conformance test: each kind (SQLite, PostgreSQL, directory) passes the same tests.

walbuf.buffer.Buffer is all that callers ask of a buffer; these are the
behaviours they rely on, whatever the kind (as Litestream tests each
ReplicaClient). A kind added later passes this file first.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import fresh_buffer, require_postgres

import walbuf
from walbuf.buffer import Buffer, open_buffer

KINDS = ["sqlite", "postgresql", "directory"]


@pytest.fixture(params=KINDS)
def location(request: pytest.FixtureRequest) -> Iterator[str]:
    """A buffer of the kind that does not exist yet."""
    if request.param == "postgresql":
        require_postgres()
    if request.param == "directory":
        with tempfile.TemporaryDirectory() as tmp:
            yield str(Path(tmp) / "buf") + "/"
        return
    with fresh_buffer(request.param) as made:
        yield str(made)


def logged(location: str, steps: int = 3) -> Buffer:
    with walbuf.Writer(location, writer="w", run="r") as w:
        for i in range(steps):
            w.log({"i": i})
    return open_buffer(location)


def test_records_read_back_in_the_order_logged(location):
    buffer = logged(location)
    assert [(r.writer, r.step, r.metrics) for r in buffer.records()] == [("w", i, {"i": i}) for i in range(3)]


def test_a_writer_is_alive_while_open_and_notes_its_close(location):
    with walbuf.Writer(location, writer="w", run="r") as w:
        w.log({"i": 0})
        assert open_buffer(location).writer_alive("r", "w")
    buffer = open_buffer(location)
    assert not buffer.writer_alive("r", "w")
    # PostgreSQL keeps the note in the database only (its lease row): None
    expected = None if str(location).startswith("postgresql") else 0
    assert buffer.writer_close_note("r", "w") == expected


def test_the_sync_lock_shows_as_running_while_held(location):
    buffer = logged(location)
    lock = buffer.sync_lock()
    assert not buffer.sync_running()
    assert lock.acquire(timeout=0)
    try:
        assert buffer.sync_running()
    finally:
        lock.release()
    assert not buffer.sync_running()


def test_after_open_for_sync_the_store_holds_every_record_and_nothing_waits_outside_it(location):
    buffer = logged(location)
    source = buffer.open_for_sync()
    with source.storage as store:
        assert [r.step for r in store.read(run="r")] == [0, 1, 2]
    assert list(buffer.backlog()) == [] and buffer.damaged() == [] and buffer.not_opened() == []
    assert buffer.all_in_store()


def test_removing_what_the_store_holds_keeps_every_record(location):
    buffer = logged(location)
    buffer.open_for_sync().storage.close()
    store = buffer.open_store("write")
    assert store is not None
    with store:
        removed, kept = buffer.remove_ingested(0, store)
    assert kept == []
    assert [r.step for r in buffer.records()] == [0, 1, 2]


def test_a_held_shard_if_any_is_released(location):
    buffer = logged(location)
    lease = buffer.hold_shard()
    if lease is not None:
        lease.release()
    assert [r.step for r in buffer.records()] == [0, 1, 2]


def test_the_size_counts_the_records(location):
    assert logged(location).size() > 0


def test_opening_for_reading_changes_nothing(location):
    buffer = logged(location)
    before = buffer.size()
    store = buffer.open_store("read")
    if store is not None:
        store.close()
    list(buffer.records())
    buffer.backlog()
    buffer.all_in_store()
    assert buffer.size() == before
