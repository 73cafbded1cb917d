"""Bytes of a shard that cannot be read: every frame around them is taken in, they are read again at each sync, and
no step walbuf takes or advises ever deletes a readable record.

A page of zeros stands for a page that never reached the disk before a
crash (later pages did) or one a client's cache holds stale; putting the
original bytes back stands for the read that gets it right later.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import pytest
from conftest import log_shard, rows_of, run_sync, the_run, walbuf_command, writer_frame

import walbuf
from walbuf.directory import frames as f
from walbuf.directory.layout import ENV_HOST

pytestmark = pytest.mark.slow  # real syncs

PAGE = 4096


@pytest.fixture
def directory(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_HOST, "node")
    return str(tmp_path / "buf") + "/"


def logged(directory, writer, n):
    with walbuf.Writer(directory, writer=writer, run="exp") as w:
        for i in range(n):
            w.log({"i": i})


def zero_page(path, at):
    """Zeros over the page of ``path`` at about ``at`` of its length; the original bytes, to put back."""
    data = path.read_bytes()
    start = int(len(data) * at) // PAGE * PAGE
    with open(path, "r+b") as file:
        file.seek(start)
        file.write(bytes(PAGE))
    return start, data


def steps(server, writer):
    return [m["i"] for _, m in rows_of(the_run(server), writer)] if server.runs else []


def sync(server, directory):
    return run_sync(server, directory, quiet=False)


def test_a_zeroed_page_in_a_sealed_shard_keeps_every_record_around_it_and_the_sync_names_what_it_held(
    server, directory
):
    logged(directory, "w", 2000)
    (shard,) = (Path(directory) / "sealed").iterdir()
    zero_page(shard, 0.25)
    proc = sync(server, directory)
    assert proc.returncode == 3, proc.stderr
    sent = steps(server, "w")
    lost = sorted(set(range(2000)) - set(sent))
    # A frame is 39 bytes or more: only those the page holds or cuts are missing.
    assert sent == sorted(sent) and len(sent) == len(set(sent)) and len(lost) <= PAGE // 39 + 2
    assert sent[-1] == 1999  # the frames after the page arrive
    assert "is damaged: bytes" in proc.stderr
    assert f"records between 'w' step {lost[0] - 1} and 'w' step {lost[-1] + 1}" in proc.stderr
    assert shard.exists()  # never moved or changed


def test_doctor_never_advises_a_step_that_deletes_readable_records(server, directory):
    logged(directory, "w", 2000)
    (shard,) = (Path(directory) / "sealed").iterdir()
    zero_page(shard, 0.25)
    sync(server, directory)
    (finding,) = [x for x in walbuf.doctor(directory).findings if not x.ok]
    assert "damaged" in finding.detail and "truncate" not in finding.advice
    assert "move the file to" in finding.advice and "deletes nothing" in finding.advice


def test_a_page_that_reads_right_later_is_taken_in_then_each_record_once(server, directory):
    logged(directory, "w", 2000)
    (shard,) = (Path(directory) / "sealed").iterdir()
    _, original = zero_page(shard, 0.25)
    assert sync(server, directory).returncode == 3
    shard.write_bytes(original)  # the page, read right
    proc = sync(server, directory)
    assert proc.returncode == 0, proc.stderr
    assert sorted(steps(server, "w")) == list(range(2000)) and len(steps(server, "w")) == 2000
    assert not shard.exists() and (Path(directory) / "ingested" / shard.name).exists()


def test_a_stale_page_of_a_live_shard_is_not_damage_and_arrives_once_read_right(server, directory):
    with walbuf.Writer(directory, writer="w", run="exp") as w:
        for i in range(2000):
            w.log({"i": i})
        (shard,) = (Path(directory) / "live" / "node").glob("*.log")
        _, original = zero_page(shard, 0.25)
        proc = sync(server, directory)
        assert proc.returncode == 0, proc.stderr  # its process may still write it: read again next time
        assert steps(server, "w")[-1] == 1999
        report = json.loads(walbuf_command("status", directory, "--json").stdout)
        (waiting,) = report["shards"]
        assert waiting["not_in_hub"] == 0 and waiting["refused"] is None  # nothing readable waits, nothing damaged
        with open(shard, "r+b") as file:
            file.write(original[: len(original)])  # the page read right; the writer's later frames stay
        assert sync(server, directory).returncode == 0
    assert sync(server, directory).returncode == 0
    assert sorted(steps(server, "w")) == list(range(2000))


def test_records_of_a_writer_named_in_an_unreadable_page_wait_for_it_and_arrive_once_it_reads(server, directory):
    first = [writer_frame(1, "a"), f.record_frame(1, 0, 1.0, '{"i": 0}')]
    hidden = writer_frame(2, "b")  # b is named here only
    after = [
        f.record_frame(2, 0, 2.0, '{"i": 0}'),
        f.record_frame(1, 1, 3.0, '{"i": 1}'),
        f.record_frame(2, 1, 4.0, '{"i": 1}'),
    ]
    shard = log_shard(directory, "node", [*first, hidden, *after], state="live")
    original = shard.read_bytes()
    at = original.index(hidden)
    with open(shard, "r+b") as file:
        file.seek(at)
        file.write(bytes(len(hidden)))
    assert sync(server, directory).returncode == 0
    assert steps(server, "a") == [0, 1] and steps(server, "b") == []  # b's frames kept for later, a's go on
    shard.write_bytes(original)
    assert sync(server, directory).returncode == 0
    assert steps(server, "a") == [0, 1] and steps(server, "b") == [0, 1]


def test_a_person_who_gives_a_damaged_range_up_moves_the_shard_to_ingested_and_nothing_readable_is_lost(
    server, directory
):
    logged(directory, "w", 2000)
    (shard,) = (Path(directory) / "sealed").iterdir()
    zero_page(shard, 0.25)
    assert sync(server, directory).returncode == 3
    sent = steps(server, "w")
    os.replace(shard, Path(directory) / "ingested" / shard.name)  # doctor's step
    assert sync(server, directory).returncode == 0
    assert steps(server, "w") == sent
    (finding,) = [x for x in walbuf.doctor(directory).findings if x.check == f"shard {shard.stem}"]
    assert finding.ok and "given up" in finding.detail
    assert walbuf.prune(directory, older_than=0).shards_removed == 1


def test_records_read_while_a_sync_takes_shards_in_are_each_read_once(directory, in_process):
    logged(directory, "w", 5)
    assert walbuf.sync(directory).runs  # the hub holds w's records, and the shard is ingested
    logged(directory, "v", 3)
    reading = walbuf.read(directory)
    first = next(reading)  # the hub's place in every shard is read now
    walbuf.sync(directory)  # takes v's shard in meanwhile
    rest = list(reading)
    assert sorted((r.writer, r.step) for r in [first, *rest]) == [("v", i) for i in range(3)] + [
        ("w", i) for i in range(5)
    ]


def test_a_reader_that_stops_midway_never_holds_the_hub_from_a_sync(directory, in_process):
    for n in range(3):
        logged(directory, f"w{n}", 1500)
    walbuf.sync(directory)
    reading = walbuf.read(directory)
    next(reading)  # a reader that stops to look, as `walbuf records | less` does
    hub = sqlite3.connect(Path(directory) / "hub.db", timeout=0)
    try:
        hub.execute("BEGIN IMMEDIATE")
        hub.execute("UPDATE runs SET created_at = created_at")
        hub.execute("COMMIT")  # a sync's commit, which a held read would refuse at once
    finally:
        hub.close()
    assert sum(1 for _ in reading) == 4499


def test_a_range_that_reads_later_as_a_frame_walbuf_never_writes_stops_nothing_after_it(server, directory):
    bad = f.frame(f.WRITER, b"{not json")  # whole, its CRC right: not a frame walbuf writes
    first = [writer_frame(1, "a"), f.record_frame(1, 0, 1.0, '{"i": 0}')]
    shard = log_shard(directory, "node", [*first, bytes(len(bad)), f.record_frame(1, 1, 2.0, '{"i": 1}')], state="live")
    assert sync(server, directory).returncode == 0
    assert steps(server, "a") == [0, 1]
    data = shard.read_bytes()
    at = data.index(bytes(len(bad)))
    shard.write_bytes(data[:at] + bad + data[at + len(bad) :] + f.record_frame(1, 2, 3.0, '{"i": 2}'))
    assert sync(server, directory).returncode == 0
    assert steps(server, "a") == [0, 1, 2]  # appended after the range: read as ever


def test_a_writer_the_hub_refuses_inside_a_full_chunk_is_taken_in_up_to_it_once(directory):
    from walbuf.directory.ingest import CHUNK, ingest
    from walbuf.directory.layout import Layout

    half = CHUNK // 2
    conflicting = f.json_frame(f.WRITER, {**json.loads(writer_frame(2, "w")[f.HEAD_SIZE :]), "step_axis": "epoch"})
    before = [writer_frame(1, "w"), *(f.record_frame(1, i, 1.0, '{"i": 0}') for i in range(half))]
    after = [f.record_frame(1, half + i, 1.0, '{"i": 0}') for i in range(half)]
    log_shard(directory, "node", [*before, conflicting, *after])  # the chunk fills after the refused writer
    hub = walbuf.open_buffer(directory).open_store("create")
    with hub:
        taken = ingest(Layout(Path(directory)), hub)
        assert "logs on step axis 'step', not 'epoch'" in taken.left_out[0]
    conn = sqlite3.connect(Path(directory) / "hub.db")
    steps = [step for (step,) in conn.execute("SELECT step FROM records ORDER BY id")]
    conn.close()
    assert steps == list(range(half))  # what came before it, each once


def test_a_shard_seen_in_two_folders_is_read_once_where_it_went(directory):
    # What a listing shows of a shard moved between the listings of sealed/ and ingested/.
    logged(directory, "w", 3)
    (sealed,) = (Path(directory) / "sealed").iterdir()
    (Path(directory) / "ingested" / sealed.name).write_bytes(sealed.read_bytes())
    (Path(directory) / "ingested" / sealed.name).chmod(0o600)
    assert [(r.writer, r.step) for r in walbuf.read(directory)] == [("w", 0), ("w", 1), ("w", 2)]


def test_a_live_shard_whose_first_frame_cannot_be_read_is_named_by_doctor_once_silent(directory):
    frames = [writer_frame(1, "w"), f.record_frame(1, 0, 1.0, '{"i": 0}')]
    shard = log_shard(directory, "node", frames, state="live")
    data = shard.read_bytes()
    shard.write_bytes(bytes(len(data) - sum(len(x) for x in frames)) + data[len(data) - sum(len(x) for x in frames) :])
    long_ago = time.time() - 3600
    os.utime(shard, (long_ago, long_ago))
    (finding,) = [x for x in walbuf.doctor(directory).findings if x.check == f"shard node.{int(shard.stem)}"]
    assert not finding.ok and "first frame" in finding.detail and "move it to" in finding.advice
