"""What a buffer location is: open_buffer tells the kinds apart, and reading changes nothing.

A file that is not a walbuf buffer, or a directory that is not a directory
buffer, is refused with a message that names what was found, and is left
byte for byte as it was, by every command that reads (status, records,
doctor, sync --dry-run) and by a writer.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_sync, walbuf_command

import walbuf
from walbuf.directory.layout import ENV_HOST, MARKER
from walbuf.store import schema

READERS = [["status"], ["records"], ["doctor"], ["sync", "--dry-run"]]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file under ``root`` with its bytes, and every folder (None), by relative path.

    The -shm file of a WAL database that a writer has open is left out: it is
    SQLite's shared memory, in which every reader marks what it reads.
    """
    found: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_dir():
            found[name] = None
        elif not name.endswith("-shm"):
            found[name] = path.read_bytes()
    return found


def another_apps_database(path: Path, journal: str = "delete") -> Path:
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA journal_mode={journal}")
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.execute("INSERT INTO users VALUES ('ada')")
    conn.commit()
    conn.close()
    return path


def a_buffer(path: Path | str) -> Path | str:
    with walbuf.Writer(path, writer="w", run="exp") as w:
        w.log({"loss": 0.5})
    return path


@pytest.mark.parametrize("journal", ["delete", "wal"])
@pytest.mark.parametrize("command", READERS, ids=" ".join)
def test_reading_another_applications_database_is_refused_and_changes_nothing(tmp_path, command, journal):
    other = another_apps_database(tmp_path / "other_app.db", journal)
    before = snapshot(tmp_path)
    proc = walbuf_command(*command, str(other))
    assert proc.returncode == 65, proc.stderr
    assert "not a walbuf buffer (its tables: users)" in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", READERS, ids=" ".join)
def test_reading_a_plain_directory_is_refused_naming_the_buffers_in_it_and_changes_nothing(tmp_path, command):
    a_buffer(tmp_path / "runs" / "exp1.db")
    before = snapshot(tmp_path)
    proc = walbuf_command(*command, str(tmp_path / "runs"))
    assert proc.returncode == 65, proc.stderr
    assert "not a walbuf directory buffer" in proc.stderr and "it holds exp1.db: give one of those" in proc.stderr
    assert snapshot(tmp_path) == before


def test_the_lock_folder_of_a_buffer_is_not_taken_for_a_directory_buffer(tmp_path):
    buffer = a_buffer(tmp_path / "runs" / "exp1.db")
    before = snapshot(tmp_path)
    proc = walbuf_command("sync", f"{buffer}.locks")
    assert proc.returncode == 65
    assert f"it is the lock folder of the buffer {buffer}: give that" in proc.stderr
    assert snapshot(tmp_path) == before


def test_reading_an_empty_directory_says_there_is_no_buffer(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = walbuf_command("status", str(tmp_path / "empty"))
    assert proc.returncode == 66 and "empty directory" in proc.stderr
    assert list((tmp_path / "empty").iterdir()) == []


@pytest.mark.parametrize("command", [["status"], ["sync", "--dry-run"], ["records"]])
def test_a_buffer_of_an_older_schema_is_read_only_after_a_write_upgrades_it(tmp_path, command):
    buffer = tmp_path / "old.db"
    engine_url = f"sqlite:///{buffer}"
    import sqlalchemy as sa

    engine = sa.create_engine(engine_url)
    with engine.begin() as conn:
        schema.upgrade(conn, schema.KNOWN_REVISIONS[0])
    engine.dispose()
    before = snapshot(tmp_path)
    proc = walbuf_command(*command, str(buffer))
    assert proc.returncode == 65 and "write it once to upgrade it" in proc.stderr
    assert snapshot(tmp_path) == before
    with walbuf.Writer(buffer, writer="w"):
        pass  # writing upgrades it
    assert walbuf_command(*command, str(buffer)).returncode == 0


def test_a_writer_refuses_another_applications_database_and_changes_nothing(tmp_path):
    other = another_apps_database(tmp_path / "other_app.db")
    before = snapshot(tmp_path)
    with pytest.raises(walbuf.NotABufferError, match="its tables: users"):
        walbuf.Writer(other, writer="w")
    assert snapshot(tmp_path) == before


def test_a_writer_refuses_a_directory_of_other_things_and_changes_nothing(tmp_path):
    a_buffer(tmp_path / "runs" / "exp1.db")
    before = snapshot(tmp_path)
    with pytest.raises(walbuf.NotABufferError, match="it holds exp1.db"):
        walbuf.Writer(tmp_path / "runs", writer="w")
    assert snapshot(tmp_path) == before


def test_a_writer_makes_an_empty_directory_a_directory_buffer_with_its_marker(tmp_path):
    (tmp_path / "buf").mkdir()
    a_buffer(tmp_path / "buf")
    assert (tmp_path / "buf" / MARKER).is_file()
    assert isinstance(walbuf.open_buffer(tmp_path / "buf"), walbuf.DirectoryBuffer)
    assert [r.metrics for r in walbuf.read(tmp_path / "buf")] == [{"loss": 0.5}]


def test_a_directory_buffer_made_before_the_marker_is_still_one(tmp_path):
    a_buffer(f"{tmp_path}/buf/")
    (tmp_path / "buf" / MARKER).unlink()
    before = snapshot(tmp_path)
    assert walbuf_command("status", str(tmp_path / "buf")).returncode == 0
    assert snapshot(tmp_path) == before  # reading does not add the marker
    a_buffer(tmp_path / "buf")  # writing does
    assert (tmp_path / "buf" / MARKER).is_file()


@pytest.mark.slow
def test_a_dry_run_of_a_directory_buffer_never_synced_changes_nothing(server, tmp_path):
    directory = tmp_path / "buf"
    with walbuf.Writer(str(directory) + "/", writer="ra", run="exp") as w:
        w.log({"i": 0})  # sealed at close: a shard for the hub, which does not exist yet
    before = snapshot(tmp_path)
    proc = run_sync(server, directory, "--dry-run", quiet=False)
    assert proc.returncode == 0, proc.stderr
    assert "1 record of shards not yet in the hub" in proc.stdout
    assert snapshot(tmp_path) == before
    assert not (directory / "hub.db").exists()


@pytest.mark.slow
def test_a_dry_run_of_a_directory_buffer_with_its_hub_and_live_shards_changes_nothing(server, tmp_path, monkeypatch):
    directory = str(tmp_path / "buf") + "/"
    monkeypatch.setenv(ENV_HOST, "s")
    with walbuf.Writer(directory, writer="rs", run="exp") as w:
        w.log({"i": 0})
    assert run_sync(server, directory, env={ENV_HOST: "s"}).returncode == 0  # the hub exists now
    with walbuf.Writer(directory, writer="rs", run="exp") as w:
        w.log({"i": 1})  # a sealed shard the hub lacks
    monkeypatch.setenv(ENV_HOST, "other")
    with walbuf.Writer(directory, writer="ro", run="exp") as other, walbuf.Writer(directory, writer="rl", run="exp"):
        other.log({"i": 2})
        monkeypatch.setenv(ENV_HOST, "s")
        with walbuf.Writer(directory, writer="live", run="exp") as live:
            live.log({"i": 3})  # this host's live shard, open
            before = snapshot(tmp_path)
            proc = run_sync(server, directory, "--dry-run", env={ENV_HOST: "s"}, quiet=False)
            assert proc.returncode == 0, proc.stderr
            # The sealed shard's, this host's live one's, and the other host's: any host reads a live shard.
            assert "and 3 records of shards not yet in the hub" in proc.stdout
            assert snapshot(tmp_path) == before


def test_twenty_logged_calls_on_a_directory_buffer_share_one_shard(tmp_path):
    directory = str(tmp_path / "buf") + "/"
    code = (
        "import sys, walbuf\n"
        "evaluate = walbuf.logged(sys.argv[1], writer='eval', run='exp')(lambda i: {'i': i})\n"
        "for i in range(20): evaluate(i)\n"
        "from pathlib import Path\n"
        "top = Path(sys.argv[1])\n"
        "print(len(list((top / 'live').rglob('*.log'))), len(list((top / 'sealed').glob('*.log'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, directory], capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["1", "0"]  # while the process runs: one live shard, none sealed
    assert len(list((tmp_path / "buf" / "sealed").glob("*.log"))) == 1  # sealed when it exited
    assert list((tmp_path / "buf" / "live").rglob("*.log")) == []
    assert [r.metrics["i"] for r in walbuf.read(directory)] == list(range(20))


def test_open_buffer_tells_the_kinds_apart(tmp_path):
    assert walbuf.open_buffer(tmp_path / "new.db", create=True).location == str(tmp_path / "new.db")
    assert isinstance(walbuf.open_buffer(f"sqlite:///{tmp_path}/new.db", create=True), walbuf.DatabaseBuffer)
    assert isinstance(walbuf.open_buffer(f"{tmp_path}/new/", create=True), walbuf.DirectoryBuffer)
    postgres = walbuf.open_buffer("postgresql://user:secret@dbhost/metrics")
    assert isinstance(postgres, walbuf.DatabaseBuffer) and "secret" not in postgres.location
    with pytest.raises(walbuf.BufferNotFoundError, match="no buffer at"):
        walbuf.open_buffer(tmp_path / "missing.db")
    with pytest.raises(walbuf.ConfigError, match="in-memory"):
        walbuf.open_buffer("sqlite:///:memory:", create=True)
    with pytest.raises(walbuf.ConfigError, match="SQLite or PostgreSQL"):
        walbuf.open_buffer("mysql://host/db", create=True)
    with pytest.raises(walbuf.ConfigError, match="no buffer given"):
        walbuf.open_buffer("", create=True)
    assert not (tmp_path / "new.db").exists() and not (tmp_path / "new").exists()  # resolving makes nothing


def test_what_the_cli_calls_is_the_library():
    from walbuf import cli

    assert (cli.sync_buffer, cli.buffer_status, cli.prune_buffer, cli.examine, cli.read) == (
        walbuf.sync,
        walbuf.status,
        walbuf.prune,
        walbuf.doctor,
        walbuf.read,
    )
