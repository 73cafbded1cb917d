"""PostgreSQL writers own their ids by a lease row, not by a session: they let their connections go while idle.

A writer renews its lease every RENEW_EVERY seconds and lets its connection
go at a renewal when it logged nothing for IDLE_SECONDS (walbuf.store.
postgresql); the tests shorten both, as a deployment could.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import workers
from conftest import run_sql

import walbuf
import walbuf.store.postgresql as postgresql
from walbuf.store.storage import writer_lock_name

pytestmark = pytest.mark.backends("postgresql")


@pytest.fixture
def quick_leases(monkeypatch):
    monkeypatch.setattr(postgresql, "RENEW_EVERY", 0.05)
    monkeypatch.setattr(postgresql, "IDLE_SECONDS", 0.0)


def test_open_writers_that_outnumber_the_servers_connections_all_log(limited_database, quick_leases):
    # The role may hold 2 connections; 5 writers stay open together. Each
    # waits for a connection to spare when it logs, which the others let go
    # while idle: none holds one for as long as it is open.
    writers = [walbuf.Writer(limited_database, writer=f"w{i}", run="r") for i in range(5)]
    try:
        for round_ in range(2):
            for i, writer in enumerate(writers):
                writer.log({"i": i, "round": round_})
    finally:
        for writer in writers:
            writer.close()
    landed = sorted((r.metrics["round"], r.writer) for r in walbuf.read(limited_database))
    assert landed == sorted((round_, f"w{i}") for round_ in range(2) for i in range(5))


def test_writer_processes_that_outnumber_the_connections_all_start_on_a_new_buffer_together(limited_database):
    # A job's first start: every rank opens the new buffer at once, and one
    # of them makes its schema while the others wait, each holding one of
    # the role's 2 connections or waiting for one.
    ctx = mp.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=workers.starting_writer, args=(limited_database, i, 3, go)) for i in range(6)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * 6
    assert sorted((r.writer, r.step) for r in walbuf.read(limited_database)) == [
        (f"w{i:02d}", step) for i in range(6) for step in range(3)
    ]


def test_a_writer_killed_on_this_host_leaves_its_id_free_at_once(buffer):
    job = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "stdin_writer.py"), buffer, "w", "r"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    job.stdin.write("1\n")
    job.stdin.flush()
    assert job.stdout.readline() == "logged 1\n"
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    assert not walbuf.open_buffer(buffer).writer_alive("r", "w")
    with walbuf.Writer(buffer, writer="w", run="r", wait=0) as writer:  # its lease has a minute left
        assert writer.log({"i": 2}) == 1


def plant_lease(buffer, name, *, expires_in):
    """A lease of writer ``name`` of run "r" held by a process on another host, as its row would be."""
    run_sql(
        buffer,
        "INSERT INTO writer_leases (name, holder, host, boot_id, pid, started, expires_at)"
        " VALUES (:name, 'theirs', 'elsewhere', 'another-boot', 1, '1',"
        " extract(epoch FROM clock_timestamp()) + :expires_in)",
        {"name": writer_lock_name("r", name), "expires_in": expires_in},
    )


def test_a_lease_held_on_another_host_keeps_the_id_until_it_runs_out(buffer):
    walbuf.Writer(buffer, writer="setup", run="r").close()  # the schema, made
    plant_lease(buffer, "w", expires_in=3600)
    assert walbuf.open_buffer(buffer).writer_alive("r", "w")
    with pytest.raises(walbuf.WriterConflictError, match="already open"):
        walbuf.Writer(buffer, writer="w", run="r", wait=0).log({"i": 1})
    run_sql(buffer, "UPDATE writer_leases SET expires_at = expires_at - 7200")
    assert not walbuf.open_buffer(buffer).writer_alive("r", "w")
    with walbuf.Writer(buffer, writer="w", run="r", wait=0) as writer:
        writer.log({"i": 2})
    assert [r.metrics for r in walbuf.read(buffer)] == [{"i": 2}]


def test_a_writer_whose_lease_was_taken_over_writes_nothing_more(buffer):
    writer = walbuf.Writer(buffer, writer="w", run="r")
    writer.log({"i": 1})
    # What a process on another host does once this writer's lease ran out.
    run_sql(buffer, "UPDATE writer_leases SET holder = 'theirs', host = 'elsewhere'")
    with pytest.raises(walbuf.WriterConflictError, match="took the id over"):
        writer.log({"i": 2})
    writer.close()
    assert [r.metrics for r in walbuf.read(buffer)] == [{"i": 1}]
    assert run_sql(buffer, "SELECT holder FROM writer_leases") == [("theirs",)]  # its close left their lease alone
