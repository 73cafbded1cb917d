"""walbuf doctor: a healthy buffer passes; damage, a dead syncer's upload and failed syncs need a person."""

from __future__ import annotations

import os
import sqlite3
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import run_sql

import walbuf
from walbuf import doctor
from walbuf.cli import main

pytestmark = pytest.mark.backends("sqlite", "postgresql")


def make(buffer, n=3):
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        for i in range(n):
            w.log({"i": i})


def failing(report):
    return {f.check for f in report.findings if not f.ok}


def test_healthy_buffer_passes_and_shows_pending(buffer, backend):
    make(buffer)
    report = doctor(buffer)
    assert report.healthy
    assert any(f.check == "run r" and "3 pending" in f.detail for f in report.findings)
    result = CliRunner().invoke(main, ["doctor", str(buffer)])
    first_check = {"sqlite": "integrity: ok", "postgresql": "server: PostgreSQL"}[backend]
    assert result.exit_code == 0 and first_check in result.output


def test_upload_left_running_by_a_dead_syncer_needs_a_person(buffer):
    make(buffer)
    run_sql(
        buffer,
        "INSERT INTO syncs (run_id, mode, status, started_at, last_id, records, host, pid)"
        " VALUES (1, 'online', 'running', 0, 3, 3, 'h', 4242)",
    )
    assert failing(doctor(buffer)) == {"interrupted sync"}
    result = CliRunner().invoke(main, ["doctor", str(buffer)])
    assert result.exit_code == 1 and "run walbuf sync" in result.output


def test_a_last_sync_that_found_w_and_b_unreachable_needs_no_person(buffer):
    make(buffer)
    run_sql(
        buffer,
        "INSERT INTO syncs (run_id, mode, status, started_at, last_id, records, host, pid, message)"
        " VALUES (1, 'online', 'unreachable', 0, 3, 3, 'h', 1, 'W&B could not be reached')",
    )
    report = doctor(buffer)
    assert report.healthy
    assert any("W&B could not be reached; the next sync retries" in f.detail for f in report.findings)


def test_failed_last_sync_is_reported_with_its_message(buffer):
    make(buffer)
    run_sql(
        buffer,
        "INSERT INTO syncs (run_id, mode, status, started_at, last_id, records, host, pid, message)"
        " VALUES (1, 'online', 'failed', 0, 3, 3, 'h', 1, 'W&B did not open run')",
    )
    report = doctor(buffer)
    assert failing(report) == {"run r last sync"}
    assert any("W&B did not open run" in f.detail for f in report.findings)


def test_newer_schema_needs_an_upgrade(buffer):
    make(buffer)
    run_sql(buffer, "UPDATE alembic_version SET version_num = '9999'")
    assert failing(doctor(buffer)) == {"schema"}


@pytest.mark.backends("sqlite")
def test_damaged_file_fails_integrity(buffer):
    make(buffer, n=2000)
    with sqlite3.connect(buffer) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(buffer.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = b"\xff" * 4096
    buffer.write_bytes(bytes(data))
    assert "integrity" in failing(doctor(buffer))


def test_missing_buffer_exits_66(tmp_path):
    assert CliRunner().invoke(main, ["doctor", str(tmp_path / "nope.db")]).exit_code == 66
    with pytest.raises(walbuf.BufferNotFoundError):
        doctor(tmp_path / "nope.db")


@pytest.mark.backends("sqlite")
def test_the_group_commit_file_an_older_walbuf_left_is_never_opened_and_doctor_passes(buffer):
    # As walbuf 8a96cb1's writers left it in the lock folder: 65 pages of 4 KiB,
    # owner-only, every slot free; bytes 8-15 count the WAL's pages.
    make(buffer, n=2)
    leftover = buffer.with_name(buffer.name + ".locks") / "group-commit-1"
    left = bytearray(4096 * 65)
    left[8:16] = struct.pack("<Q", 123 * 1024)
    leftover.write_bytes(bytes(left))
    leftover.chmod(0o600)
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"i": 2})
        assert str(leftover) not in {os.readlink(fd) for fd in Path("/proc/self/fd").iterdir() if fd.is_symlink()}
    assert [r.metrics["i"] for r in walbuf.read(buffer)] == [0, 1, 2]
    report = doctor(buffer)
    assert report.healthy, [f for f in report.findings if not f.ok]
    assert leftover.read_bytes() == left
