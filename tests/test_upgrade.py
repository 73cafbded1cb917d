"""An older walbuf's directory buffer (SQLite shards) upgraded: every record it holds arrives, each once.

tests/data/upgrade-d02335a.tar.gz is a buffer walbuf at d02335a wrote and
synced once (scripts/make_upgrade_fixture.py says how, and what it holds):
live SQLite shards on hosts old1 (half taken in) and n2, a sealed one of
old2, an ingested one of n1, and the hub at revision 0010 with its
shard cursors. manifest: what was logged, and what that sync sent.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from conftest import legacy_shard, log_shard, rows_of, run_sync, the_run, walbuf_command, writer_frame

import walbuf
from walbuf.directory import frames as f
from walbuf.directory.layout import ENV_HOST

pytestmark = pytest.mark.slow  # real syncs

DATA = Path(__file__).parent / "data"
MANIFEST = json.loads((DATA / "upgrade-d02335a.json").read_text())


@pytest.fixture
def older(tmp_path):
    """The buffer walbuf at d02335a left (see the module docstring), as a path ending in '/'."""
    with tarfile.open(DATA / "upgrade-d02335a.tar.gz") as tar:
        tar.extractall(tmp_path, filter="tar")
    return str(tmp_path / "buf") + "/"


def sync_on(server, host, buffer, *args):
    return run_sync(server, buffer, *args, env={ENV_HOST: host}, quiet=False)


def hub_revision(buffer):
    conn = sqlite3.connect(f"file:{Path(buffer) / 'hub.db'}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    finally:
        conn.close()


def arrived(server, writers):
    """writer -> the steps the fake server holds of it, in arrival order."""
    if not server.runs:
        return {w: [] for w in writers}
    fake_run = the_run(server)
    return {w: [int(m["i"]) for _, m in rows_of(fake_run, w)] for w in writers}


def test_a_buffer_of_walbuf_at_d02335a_sends_every_record_once_once_its_older_live_shards_hosts_synced(server, older):
    logged, sent = MANIFEST["logged"], MANIFEST["sent"]
    first = sync_on(server, "n2", older)  # n2's older shard: no process uses it, so it is sealed here
    assert first.returncode == 78, first.stderr
    assert "old1" in first.stderr and "stop the older walbuf's jobs on old1" in first.stderr
    assert hub_revision(older) == "0010" and not server.runs  # nothing taken in, nothing sent
    second = sync_on(server, "old1", older)
    assert second.returncode == 0, second.stderr
    assert hub_revision(older) == walbuf.store.schema.HEAD_REVISION
    got = arrived(server, logged)
    for writer, steps in logged.items():
        assert Counter(sent.get(writer, []) + got[writer]) == Counter(steps), writer  # every record, each once
    assert sync_on(server, "old1", older).returncode == 0
    assert arrived(server, logged) == got  # nothing sent again
    report = json.loads(walbuf_command("status", older, "--json").stdout)
    assert report["shards"] == [] and report["damaged_shards"] == [] and report["not_opened"] == []


def test_a_sync_of_another_host_while_an_older_live_shard_remains_changes_nothing_and_says_what_to_do(server, older):
    before = sorted(str(p.relative_to(older)) for p in Path(older).rglob("*"))
    proc = sync_on(server, "login", older)
    assert proc.returncode == 78, proc.stderr
    for host in ("old1", "n2"):
        assert f"stop the older walbuf's jobs on {host}, then run walbuf sync on {host} once" in proc.stderr
    assert sorted(str(p.relative_to(older)) for p in Path(older).rglob("*")) == before
    assert hub_revision(older) == "0010" and not server.runs
    (finding,) = [x for x in walbuf.doctor(older).findings if not x.ok and "n2" in x.check + x.advice]
    assert "run walbuf sync on n2 once" in finding.advice


def test_an_older_sealed_shard_is_taken_in_once_when_the_sync_is_killed_between_its_two_renames(server, tmp_path):
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("no strace: apt-get install strace")
    buffer = str(tmp_path / "buf") + "/"
    legacy_shard(buffer, "old", "a", 5, sealed=True)
    # The converter's renames: its shard of frames into sealed/, then the older shard into ingested/.
    killed = run_sync(
        server,
        buffer,
        prefix=(strace, "-f", "-o", "/dev/null", "-e", "trace=rename", "-e", "inject=rename:signal=SIGKILL:when=2"),
    )
    assert killed.returncode != 0
    assert [p.name for p in (tmp_path / "buf" / "sealed").iterdir() if p.suffix == ".log"]  # made, not yet moved on
    assert run_sync(server, buffer).returncode == 0
    assert Counter(arrived(server, ["a"])["a"]) == Counter(range(5))


def test_an_older_shard_holding_a_view_is_never_read_and_the_other_shards_arrive(server, tmp_path):
    buffer = str(tmp_path / "buf") + "/"
    spun = legacy_shard(buffer, "old", "spun", 3, sealed=True)
    conn = sqlite3.connect(spun)
    conn.execute("CREATE VIEW loop AS SELECT * FROM records")
    conn.commit()
    conn.close()
    log_shard(buffer, "n1", [writer_frame(1, "fine"), f.record_frame(1, 0, 1.0, '{"i": 0}')])
    proc = run_sync(server, buffer, quiet=False)
    assert proc.returncode == 3 and "view 'loop'" in proc.stderr, proc.stderr
    assert spun.exists()  # never moved: a person looks
    assert arrived(server, ["fine", "spun"]) == {"fine": [0], "spun": []}


def test_an_older_walbufs_quarantined_shard_is_named_by_doctor_with_how_to_recover_it(tmp_path):
    buffer = str(tmp_path / "buf") + "/"
    shard = legacy_shard(buffer, "old", "a", 3, sealed=True)
    quarantine = tmp_path / "buf" / "quarantine"
    quarantine.mkdir()
    os.replace(shard, quarantine / shard.name)
    (quarantine / f"{shard.name}.why").write_text("SQLite's quick_check finds it damaged\n")
    report = walbuf.doctor(buffer)
    (finding,) = [x for x in report.findings if not x.ok]
    assert "quick_check" in finding.detail and ".recover" in finding.advice
    status = json.loads(walbuf_command("status", buffer, "--json").stdout)
    assert status["damaged_shards"] == [f"{shard.stem}: SQLite's quick_check finds it damaged"]


def test_a_writer_starts_on_a_buffer_whose_hub_an_older_walbuf_made(older):
    # Its last step comes from the older hub, which only a sync upgrades.
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import walbuf; w = walbuf.Writer(__import__('sys').argv[1], writer='c', run='exp');"
            " print(w.log({'i': 1}))",
            older,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, ENV_HOST: "n3"},
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == max(MANIFEST["logged"]["c"]) + 1


def test_prune_before_the_older_shards_are_taken_in_changes_nothing_and_says_to_sync_first(server, older):
    proc = walbuf_command("prune", older, "--older-than", "0s")
    assert proc.returncode == 78 and "run walbuf sync first" in proc.stderr, proc.stderr
    assert hub_revision(older) == "0010"  # not upgraded: it keeps what it took in of them
    assert sync_on(server, "n2", older).returncode == 78
    assert sync_on(server, "old1", older).returncode == 0
    got = arrived(server, MANIFEST["logged"])
    for writer, steps in MANIFEST["logged"].items():
        assert Counter(MANIFEST["sent"].get(writer, []) + got[writer]) == Counter(steps), writer
