"""The buffer on disk: schema and migrations, reading, and damaged or foreign files."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from conftest import buffer_exists, buffer_url, run_sql

import walbuf
import walbuf.migrations
from walbuf.store import schema

pytestmark = pytest.mark.backends("sqlite", "postgresql")


def make_buffer(buffer, records=1):
    with walbuf.Writer(buffer, writer="w") as w:
        for i in range(records):
            w.log({"i": i})


def test_new_buffer_is_at_the_newest_schema_revision(buffer):
    make_buffer(buffer)
    assert run_sql(buffer, "SELECT version_num FROM alembic_version") == [(schema.HEAD_REVISION,)]


def test_known_revisions_list_matches_alembics_migrations():
    config = Config()
    config.set_main_option("script_location", walbuf.migrations.__path__[0])
    script = ScriptDirectory.from_config(config)
    oldest_first = [rev.revision for rev in reversed(list(script.walk_revisions()))]
    assert tuple(oldest_first) == schema.KNOWN_REVISIONS


def test_migrated_schema_matches_the_tables_the_code_uses(buffer):
    make_buffer(buffer)
    engine = sa.create_engine(buffer_url(buffer))
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), schema.metadata)
    engine.dispose()
    assert diff == []


def test_opening_a_current_buffer_does_not_import_alembic(buffer):
    make_buffer(buffer)
    code = (
        "import sys, walbuf\n"
        f"walbuf.Writer({str(buffer)!r}, writer='w2').log({{'a': 1}})\n"
        f"list(walbuf.read({str(buffer)!r}))\n"
        "assert 'alembic' not in sys.modules, 'alembic was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_buffer_from_a_newer_schema_is_refused_and_left_untouched(buffer):
    make_buffer(buffer)
    run_sql(buffer, "UPDATE alembic_version SET version_num = '9999_future'")
    before = buffer.read_bytes() if isinstance(buffer, Path) else None
    with pytest.raises(walbuf.SchemaTooNewError, match="upgrade walbuf"):
        walbuf.Writer(buffer, writer="w")
    with pytest.raises(walbuf.SchemaTooNewError):
        list(walbuf.read(buffer))
    assert run_sql(buffer, "SELECT version_num FROM alembic_version") == [("9999_future",)]
    assert run_sql(buffer, "SELECT count(*), count(DISTINCT writer_id) FROM records") == [(1, 1)]
    assert run_sql(buffer, "SELECT count(*) FROM writers") == [(1,)]
    if before is not None:
        assert buffer.read_bytes() == before


@pytest.mark.backends("sqlite")
def test_file_that_is_not_a_database_is_reported_as_corrupt(buffer):
    buffer.parent.mkdir(parents=True)
    buffer.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(walbuf.BufferCorruptError, match="not a readable walbuf buffer"):
        walbuf.Writer(buffer, writer="w")
    assert buffer.read_bytes() == b"this is not sqlite" * 100


def test_reading_a_missing_buffer_raises_and_creates_nothing(buffer):
    with pytest.raises(walbuf.BufferNotFoundError, match="no .*buffer"):
        list(walbuf.read(buffer))
    assert not buffer_exists(buffer)


@pytest.mark.backends("postgresql")
def test_unreachable_server_is_its_own_error():
    with pytest.raises(walbuf.BufferUnavailableError, match="cannot reach"):
        walbuf.Writer("postgresql+psycopg://walbuf@127.0.0.1:9/walbuf", writer="w")


@pytest.mark.backends("postgresql")
def test_a_writer_the_server_has_no_connection_for_waits_for_one_and_logs(limited_database):
    import psycopg

    held = [
        psycopg.connect(limited_database.replace("+psycopg", "")) for _ in range(2)
    ]  # every connection the role may have
    job = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "stdin_writer.py"), limited_database, "w", "r"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = job.stderr.readline()
    assert "the server has no connection to spare" in line and "too many connections" in line, line + job.stderr.read()
    for conn in held:
        conn.close()
    out, err = job.communicate("1\n", timeout=120)
    assert (job.returncode, out) == (0, "logged 1\nclosed\n"), err
    assert [r.metrics for r in walbuf.read(limited_database)] == [{"i": 1}]


def test_read_filters_by_run_and_writer(buffer):
    with walbuf.Writer(buffer, writer="a", run="r1") as a, walbuf.Writer(buffer, writer="b", run="r2") as b:
        a.log({"x": 1})
        b.log({"x": 2})
        a.log({"x": 3})
    assert [r.metrics["x"] for r in walbuf.read(buffer, run="r1")] == [1, 3]
    assert [r.metrics["x"] for r in walbuf.read(buffer, writer="b")] == [2]
    assert [r.metrics["x"] for r in walbuf.read(buffer)] == [1, 2, 3]


def test_read_sees_one_snapshot(buffer):
    make_buffer(buffer, records=3)
    records = walbuf.read(buffer)
    first = next(records)
    with walbuf.Writer(buffer, writer="late") as late:
        late.log({"late": True})
    assert [first, *records][-1].writer == "w"


def test_buffer_at_an_older_revision_is_upgraded_keeping_its_records(buffer):
    if isinstance(buffer, Path):
        buffer.parent.mkdir(parents=True)
    engine = sa.create_engine(buffer_url(buffer))
    with engine.begin() as conn:
        schema.upgrade(conn, KNOWN_OLDEST)
        conn.exec_driver_sql("INSERT INTO runs (id, name, created_at) VALUES (1, 'old', 0)")
        conn.exec_driver_sql(
            "INSERT INTO writers (id, run_id, name, step_axis, host, pid, opened_at)"
            " VALUES (1, 1, 'w', 'step', 'h', 1, 0)"
        )
        conn.exec_driver_sql("INSERT INTO records (writer_id, step, time, metrics) VALUES (1, 4, 0, '{\"a\": 1}')")
    engine.dispose()
    with walbuf.Writer(buffer, writer="w", run="old") as w:
        assert w.log({"a": 2}) == 5
    assert [(r.step, r.metrics) for r in walbuf.read(buffer)] == [(4, {"a": 1}), (5, {"a": 2})]
    assert run_sql(buffer, "SELECT version_num FROM alembic_version") == [(schema.HEAD_REVISION,)]


KNOWN_OLDEST = schema.KNOWN_REVISIONS[0]


# A trigger that would rewrite every record a writer logs: what a co-tenant could plant.
TRIGGERS = {
    "sqlite": ["CREATE TRIGGER rewrite AFTER INSERT ON records BEGIN UPDATE records SET metrics = '{}'; END"],
    "postgresql": [
        "CREATE FUNCTION rewrite() RETURNS trigger AS $$ BEGIN NEW.metrics := '{}'; RETURN NEW; END $$"
        " LANGUAGE plpgsql",
        "CREATE TRIGGER rewrite BEFORE INSERT ON records FOR EACH ROW EXECUTE FUNCTION rewrite()",
    ],
}


def test_a_buffer_holding_a_trigger_is_refused_before_it_can_run(buffer, backend):
    make_buffer(buffer)
    for statement in TRIGGERS[backend]:
        run_sql(buffer, statement)
    with pytest.raises(walbuf.NotABufferError, match="trigger 'rewrite'"):
        with walbuf.Writer(buffer, writer="w") as w:
            w.log({"i": 1})
    with pytest.raises(walbuf.NotABufferError, match="trigger 'rewrite'"):
        list(walbuf.read(buffer))
    assert run_sql(buffer, "SELECT metrics FROM records") == [('{"i":0}',)]


def test_a_reader_that_keeps_the_database_past_the_busy_timeout_is_named_as_a_reader_or_writer(tmp_path):
    from walbuf.store import Storage
    from walbuf.store.sqlite import SQLiteBackend

    path = tmp_path / "hub.db"
    with Storage(SQLiteBackend(path, journal="delete"), access="create"):
        pass
    reader = sqlite3.connect(path, isolation_level=None)  # rollback journal: its read lock keeps a commit out
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM runs").fetchone()
    try:
        with Storage(SQLiteBackend(path, journal="delete"), busy_timeout=0.2) as storage:
            with pytest.raises(walbuf.BufferBusyError, match="reading or writing .* walbuf status"):
                storage.register_writer("exp", "w", "step", "w", "h", 1)
    finally:
        reader.close()
