"""Shared storage is hostile: a co-tenant never makes walbuf write, read or run anything as a buffer's owner.

The owner is the suite's account (root); the co-tenant a second account
(see conftest.cotenant), in the owner's project group, sharing world-writable
scratch. Today's walbuf leaves the co-tenant no folder to plant anything in;
so that the defences behind that are tested too, most tests first open one
folder of the buffer to the project group, as walbuf did before (at umask
002), let the co-tenant plant what it likes, then make the buffer private
again, as docs/guarantees.md tells an owner to: what the co-tenant planted is still
there. Root ignores file modes, so that the owner is not stopped by them:
what stops it is walbuf's own checks (docs/security.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import stat
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import legacy_shard, log_shard, rows_of, run_sync, walbuf_command, writer_frame

import walbuf
from walbuf.store.storage import writer_lock_name

pytestmark = pytest.mark.slow  # real processes, a second account

HOST = "node1"
VICTIM_TEXT = "the owner's own file\n"


@pytest.fixture(autouse=True)
def _one_host(monkeypatch):
    monkeypatch.setenv("WALBUF_HOST", HOST)


@pytest.fixture
def victim(tmp_path):
    """A file of the owner's in a folder only the owner may enter (its ~/.bashrc, say)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    path = home / "bashrc"
    path.write_text(VICTIM_TEXT)
    return path


def log(buffer, writer="trainer", n=3, run="exp", **settings):
    with walbuf.Writer(buffer, writer=writer, run=run, **settings) as w:
        for i in range(n):
            w.log({"loss": 1.0 / (i + 1)})


def cron(server, buffer):
    """walbuf-cron, as cron runs it (its full path, cron's bare PATH)."""
    command = Path(sys.executable).parent / "walbuf-cron"
    return subprocess.run(
        [str(command), str(buffer)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "WALBUF_HOST": HOST, **server.env()},
    )


@contextmanager
def opened_to_the_group(buffer: Path, folder: Path, cotenant):
    """``folder`` of ``buffer`` writable by the project group, as walbuf before issue 22 left it at umask 002.

    Afterwards the buffer is made private again with the command docs/guarantees.md gives
    (``chmod -R go-w``): what was planted meanwhile stays.
    """
    for path in (buffer, folder):
        os.chown(path, 0, cotenant.group)
    buffer.chmod(0o750)
    folder.chmod(0o770)
    try:
        yield
    finally:
        subprocess.run(["chmod", "-R", "go-w", str(buffer)], check=True)


def made_and_synced_at_umask_002(server, buffer: Path) -> None:
    """A directory buffer logged to and synced under umask 002, the umask of group project work."""
    old = os.umask(0o002)
    try:
        log(str(buffer) + "/")
        assert run_sync(server, buffer).returncode == 0
    finally:
        os.umask(old)


def plant(cotenant, script):
    proc = cotenant.run(script)
    assert proc.returncode == 0, f"the co-tenant could not plant it: {proc.stderr}"


def modes(root: Path) -> dict[str, int]:
    """Every path under ``root`` (``root`` too), with its permission bits."""
    found = {".": stat.S_IMODE(os.lstat(root).st_mode)}
    for folder, names, files in os.walk(root):
        for name in names + files:
            path = Path(folder, name)
            found[str(path.relative_to(root))] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


# -- 7. nothing is readable or writable by others by default -----------------------------


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o000])
def test_every_file_and_folder_of_a_directory_buffer_is_owner_only_whatever_the_umask(
    server, shared_folders, cotenant, umask
):
    _, project = shared_folders
    buffer = project / "exp"
    old = os.umask(umask)
    try:
        log(str(buffer) + "/")
        assert run_sync(server, buffer).returncode == 0
        assert walbuf_command("prune", buffer, "--older-than", "0s").returncode == 0
    finally:
        os.umask(old)
    found = modes(buffer)
    assert {name: mode for name, mode in found.items() if mode & 0o077} == {}
    assert {"hub.db", "locks", "walbuf.buffer"} <= set(found)
    proc = cotenant.run(f"cat {buffer}/hub.db >/dev/null")
    assert proc.returncode != 0 and "Permission denied" in proc.stderr


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_a_sqlite_buffer_and_its_folders_are_owner_only_whatever_the_umask(shared_folders, cotenant, umask):
    _, project = shared_folders
    buffer = project / "runs" / "exp.db"
    old = os.umask(umask)
    try:
        with walbuf.Writer(buffer, writer="trainer", run="exp") as w:
            w.log({"loss": 0.5})
            found = modes(buffer.parent)  # while it is open: with its -wal and -shm
    finally:
        os.umask(old)
    assert {name: mode for name, mode in found.items() if mode & 0o077} == {}
    assert {"exp.db", "exp.db-wal", "exp.db-shm", "exp.db.locks"} <= set(found)
    proc = cotenant.run(f"cat {buffer} >/dev/null")
    assert proc.returncode != 0 and "Permission denied" in proc.stderr


def test_read_access_granted_on_purpose_reaches_the_shards_walbuf_makes_later_but_never_its_locks(
    server, shared_folders, cotenant
):
    _, project = shared_folders
    buffer = project / "exp"
    log(str(buffer) + "/")
    subprocess.run(["chgrp", "-R", str(cotenant.group), str(buffer)], check=True)
    subprocess.run(["chmod", "-R", "g+rX", str(buffer)], check=True)  # the whole buffer, locks too
    log(str(buffer) + "/", writer="later")
    assert run_sync(server, buffer).returncode == 0
    shards = sorted((buffer / "ingested").iterdir())
    assert len(shards) == 2
    proc = cotenant.run(f"cat {shards[-1]} {buffer}/hub.db >/dev/null")  # made after the grant
    assert proc.returncode == 0, proc.stderr
    for folder in ("locks", "live"):  # taken back at walbuf's next use
        proc = cotenant.run(f"ls {buffer}/{folder}")
        assert proc.returncode != 0 and "Permission denied" in proc.stderr, folder


# -- 1. a co-tenant never runs code as the owner ------------------------------------------


def test_a_buffer_made_at_umask_002_in_a_project_folder_leaves_the_cotenant_no_folder_to_plant_in(
    server, shared_folders, cotenant
):
    _, project = shared_folders
    buffer = project / "exp"
    made_and_synced_at_umask_002(server, buffer)
    for folder in ("", "live", f"live/{HOST}", "sealed", "ingested", "locks"):
        proc = cotenant.run(f"ln -s /etc/passwd {buffer / folder}/planted")
        assert proc.returncode != 0 and "Permission denied" in proc.stderr, folder


@pytest.mark.parametrize("kind", ["directory", "sqlite"])
def test_a_buffer_the_cotenant_made_first_in_scratch_is_refused_and_nothing_is_written_there(
    server, shared_folders, cotenant, kind
):
    scratch, _ = shared_folders
    if kind == "directory":
        buffer = scratch / "exp"
        plant(cotenant, f"mkdir -m 777 {buffer} {buffer}/live {buffer}/sealed {buffer}/locks {buffer}/quarantine")
        location = str(buffer) + "/"
    else:
        buffer = scratch / "exp.db"
        plant(cotenant, f"touch {buffer} && chmod 666 {buffer}")
        location = buffer
    with pytest.raises((walbuf.BufferNotWritableError, walbuf.UntrustedPathError), match="walbuf-cotenant|others"):
        walbuf.Writer(location, writer="trainer", run="exp")
    proc = run_sync(server, location)
    assert proc.returncode == 77, proc.stderr
    assert "walbuf-cotenant" in proc.stderr or "may be written by" in proc.stderr
    owned = [p for p in [buffer, *buffer.rglob("*")] if os.lstat(p).st_uid == os.geteuid()]
    assert owned == []


def test_a_shard_name_with_shell_commands_is_reported_and_nothing_is_written_through_its_planted_note(
    server, shared_folders, cotenant, victim
):
    scratch, project = shared_folders
    buffer = project / "exp"
    log(str(buffer) + "/")
    (buffer / "quarantine").mkdir()
    name = "x\n;touch walbuf-pwned\n.1"
    with (
        opened_to_the_group(buffer, buffer / "sealed", cotenant),
        opened_to_the_group(buffer, buffer / "quarantine", cotenant),
    ):
        plant(
            cotenant,
            f"printf garbage > '{buffer}/sealed/{name}.db' && ln -s {victim} '{buffer}/quarantine/{name}.db.why'",
        )
    proc = cron(server, buffer)
    assert victim.read_text() == VICTIM_TEXT
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert repr(f"{buffer}/sealed/{name}.db") in proc.stderr  # quoted: its newlines forge no log line
    assert proc.stdout.count("\n") == 1  # cron's one line
    assert rows_of(next(iter(server.runs.values())), "trainer", "step")  # the owner's records went on


def test_a_link_planted_in_an_older_walbufs_quarantine_is_never_followed(server, shared_folders, cotenant, victim):
    _, project = shared_folders
    buffer = project / "exp"
    log(str(buffer) + "/")
    shard = legacy_shard(buffer, HOST, "old", 3, sealed=True)
    shard.write_bytes(b"not a database, damaged")  # the owner's own older shard, damaged
    (buffer / "quarantine").mkdir()
    with opened_to_the_group(buffer, buffer / "quarantine", cotenant):
        plant(cotenant, f"ln -s {victim} {buffer}/quarantine/{shard.name}.why")
    proc = cron(server, buffer)
    assert victim.read_text() == VICTIM_TEXT
    assert proc.returncode == 3, proc.stdout
    assert "is a symbolic link" in proc.stderr and "needs a person" in proc.stdout
    assert shard.exists()  # reported, never moved


@pytest.mark.parametrize("where", ["scratch", "project"])
def test_a_sqlite_buffer_in_a_folder_others_may_make_files_in_is_refused_and_nothing_is_written(
    server, shared_folders, cotenant, where
):
    scratch, project = shared_folders
    folder = scratch if where == "scratch" else project
    buffer = folder / "exp.db"
    before = sorted(folder.iterdir())
    with pytest.raises(walbuf.UntrustedPathError, match="may make files: another account could put a -wal"):
        walbuf.Writer(buffer, writer="trainer", run="exp")
    assert sorted(folder.iterdir()) == before
    # A buffer made elsewhere and moved there is refused as well, for reading and syncing.
    private = Path(tempfile.mkdtemp(dir=folder.parent)) / "exp.db"
    log(private)
    os.replace(private, buffer)
    try:
        proc = cron(server, buffer)
        assert proc.returncode == 77, proc.stdout
        assert "may make files" in proc.stdout and server.runs == {}
        assert walbuf_command("status", buffer).returncode == 77
    finally:
        buffer.unlink()


def test_a_cotenants_fifo_beside_a_buffer_in_scratch_gets_advice_the_owner_can_follow(shared_folders, cotenant):
    scratch, _ = shared_folders
    buffer = scratch / "exp.db"
    plant(cotenant, f"mkfifo -m 666 {buffer}-journal")
    with pytest.raises(walbuf.UntrustedPathError) as refused:
        walbuf.Writer(buffer, writer="trainer", run="exp")
    # The owner cannot remove the co-tenant's file in a sticky folder: it can move its buffer.
    assert "move it into a folder only you may write" in str(refused.value)
    assert "remove it" not in str(refused.value)


@pytest.mark.parametrize("kind", ["sqlite", "directory"])
def test_a_hard_link_of_another_file_in_a_buffer_is_never_written_through(server, tmp_path, victim, kind):
    # Where a client without protected_hardlinks let a co-tenant link the owner's file in.
    if kind == "sqlite":
        buffer = tmp_path / "exp.db"
        log(buffer)
        planted = [Path(f"{buffer}-shm")]
        location: object = buffer
    else:
        buffer = tmp_path / "exp"
        log(str(buffer) + "/")
        planted = [buffer / "locks" / f"{writer_lock_name('exp', 'other')}.lock", buffer / "locks" / "sync.lock"]
        location = str(buffer) + "/"
    for path in planted:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.link(victim, path)
    with pytest.raises(walbuf.UntrustedPathError, match=r"names \(hard links\)"):
        walbuf.Writer(location, writer="other", run="exp").log({"loss": 0.0})
    proc = cron(server, buffer)
    assert proc.returncode == 77, proc.stdout
    assert "hard links" in proc.stdout
    assert victim.read_text() == VICTIM_TEXT


@pytest.mark.parametrize("kind", ["sqlite", "directory"])
def test_a_link_another_account_made_at_the_buffers_path_is_never_followed(
    server, shared_folders, cotenant, tmp_path, kind
):
    scratch, _ = shared_folders
    private = tmp_path / ("exp.db" if kind == "sqlite" else "exp")  # in a folder only the owner may enter
    log(private if kind == "sqlite" else str(private) + "/")
    lure = scratch / ("team-exp2.db" if kind == "sqlite" else "team-exp2")
    plant(cotenant, f"ln -s {private} {lure}")
    proc = cron(server, lure if kind == "sqlite" else f"{lure}/")
    assert proc.returncode == 77, proc.stdout
    assert "is a symbolic link of walbuf-cotenant" in proc.stdout
    assert server.runs == {}  # the owner's private records went nowhere
    with pytest.raises(walbuf.UntrustedPathError, match="symbolic link of walbuf-cotenant"):
        walbuf.Writer(lure if kind == "sqlite" else f"{lure}/", writer="w", run="exp")


# -- 2. a co-tenant never reads the owner's files through the owner's sync ----------------


@pytest.mark.parametrize("name", ["{secret}?x=.1.db", "node9.1.db#", "node9.1.db?mode=rwc"])
def test_a_shard_named_like_a_uri_is_never_opened(server, shared_folders, cotenant, tmp_path, name):
    _, project = shared_folders
    secret = tmp_path / "private" / "secret.db"  # the owner's private buffer, in a 0700 folder
    log(secret, writer="secret")
    buffer = project / "exp"
    log(str(buffer) + "/")
    relative = os.path.relpath(secret, buffer / "sealed").replace("/", "%2f")
    planted = name.format(secret=relative)
    with opened_to_the_group(buffer, buffer / "sealed", cotenant):
        plant(cotenant, f"touch '{buffer}/sealed/{planted}'")
    proc = run_sync(server, buffer)
    assert proc.returncode == 3, proc.stderr
    assert "not a name walbuf gives there" in proc.stderr
    assert {r.writer for r in walbuf.read(str(buffer) + "/")} == {"trainer"}
    assert not any("secret/loss" in row for run in server.runs.values() for row in run.history)
    assert sorted(p.name for p in (buffer / "sealed").iterdir()) == [planted]  # left where it was, never opened


def test_a_directory_buffer_at_a_path_with_uri_characters_is_read_as_that_path(server, tmp_path):
    buffer = tmp_path / "a?mode=rwc#b%2fc"
    log(str(buffer) + "/", n=5)
    proc = run_sync(server, buffer)
    assert proc.returncode == 0, proc.stderr
    (fake_run,) = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "trainer")] == [0, 1, 2, 3, 4]


# -- 3. a co-tenant never sends records with the owner's credentials ----------------------


def test_a_shard_of_another_account_is_never_sent_and_is_reported(server, shared_folders, cotenant, tmp_path):
    _, project = shared_folders
    buffer = project / "exp"
    log(str(buffer) + "/")
    with walbuf.Writer(buffer, writer="trainer", run="exp") as w:
        w.config({"lr": 0.1})
    theirs = project / "theirs"  # built with walbuf, as the co-tenant would
    with walbuf.Writer(str(theirs) + "/", writer="injected", run="exp") as w:
        w.log({"loss": 99.0})
        w.config({"lr": 666})
    (made,) = (theirs / "sealed").iterdir()
    subprocess.run(["chown", "-R", cotenant.name, str(theirs)], check=True)
    with opened_to_the_group(buffer, buffer / "sealed", cotenant):
        plant(cotenant, f"cp {made} {buffer}/sealed/node9.1.db")
    proc = run_sync(server, buffer)
    assert proc.returncode == 3, proc.stderr
    assert "node9.1.db belongs to walbuf-cotenant" in proc.stderr
    (fake_run,) = server.runs.values()
    assert fake_run.config["lr"]["value"] == 0.1
    assert not any("injected/loss" in row for row in fake_run.history)


@pytest.mark.parametrize("project, reason", [("theirs", "not 'theirs'"), ("a/b", "W&B refuses any of")])
def test_a_shard_naming_another_target_is_refused_and_the_other_records_go_on(server, tmp_path, project, reason):
    buffer = tmp_path / "exp"
    log(str(buffer) + "/", project="mine")
    assert run_sync(server, buffer).returncode == 0
    # An older walbuf's shard whose run names its own target, as a co-tenant's would.
    shard = legacy_shard(tmp_path / "elsewhere", "node2", "other", 3, sealed=True, metric="loss")
    with sqlite3.connect(shard) as conn:
        conn.execute("UPDATE runs SET project = ?", (project,))
    conn.close()
    shard.rename(buffer / "sealed" / "node2.1.db")
    log(str(buffer) + "/", writer="trainer", n=2)
    proc = run_sync(server, buffer)
    assert proc.returncode == 3, proc.stderr
    assert reason in proc.stderr
    (fake_run,) = [run for run in server.runs.values() if run.project == "mine"]
    assert [step for step, _ in rows_of(fake_run, "trainer")] == [0, 1, 2, 3, 4]
    assert not any("other/loss" in row for run in server.runs.values() for row in run.history)
    assert walbuf_command("doctor", buffer).returncode == 1


# -- 4. a buffer is data, never code ------------------------------------------------------


def test_a_hub_holding_a_trigger_is_refused_before_the_trigger_can_run(server, tmp_path):
    buffer = tmp_path / "exp"
    log(str(buffer) + "/", project="mine")
    assert run_sync(server, buffer).returncode == 0
    with sqlite3.connect(buffer / "hub.db") as conn:
        conn.execute("CREATE TRIGGER steal AFTER INSERT ON records BEGIN UPDATE runs SET project = 'theirs'; END")
    conn.close()
    log(str(buffer) + "/", n=2)
    proc = run_sync(server, buffer)
    assert proc.returncode == 65, proc.stderr
    assert "trigger 'steal'" in proc.stderr
    with sqlite3.connect(buffer / "hub.db") as conn:
        assert conn.execute("SELECT project FROM runs").fetchall() == [("mine",)]
    conn.close()


@pytest.mark.parametrize("access", ["writer", "reader"])
def test_a_sqlite_buffer_holding_a_trigger_or_a_view_is_refused(tmp_path, access):
    buffer = tmp_path / "exp.db"
    log(buffer)
    with sqlite3.connect(buffer) as conn:
        conn.execute("CREATE TRIGGER rewrite AFTER INSERT ON records BEGIN UPDATE records SET metrics = '{}'; END")
        conn.execute(
            "CREATE VIEW spin AS WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c"
        )
    conn.close()
    with pytest.raises(walbuf.NotABufferError, match="trigger 'rewrite', view 'spin'"):
        if access == "writer":
            walbuf.Writer(buffer, writer="trainer", run="exp").log({"loss": 0.0})
        else:
            list(walbuf.read(buffer))
    with sqlite3.connect(buffer) as conn:
        assert conn.execute("SELECT count(*) FROM records WHERE metrics = '{}'").fetchone() == (0,)
    conn.close()


def test_a_shard_whose_records_are_a_recursive_view_is_refused_unread(server, tmp_path):
    buffer = tmp_path / "exp"
    log(str(buffer) + "/", writer="kept")
    spun = legacy_shard(buffer, HOST, "spun", 3, sealed=True)
    with sqlite3.connect(spun) as conn:
        conn.executescript(
            "DROP TABLE records; CREATE VIEW records AS WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1"
            " FROM c) SELECT x AS id, 1 AS writer_id, x AS step, 0.0 AS time, '{}' AS metrics FROM c;"
        )
    conn.close()
    status = walbuf_command("status", buffer, "--json")
    assert status.returncode == 0, status.stderr
    assert "view 'records'" in json.dumps(json.loads(status.stdout)["shards"])
    proc = run_sync(server, buffer)
    assert proc.returncode == 3, proc.stderr
    assert spun.exists()  # never moved: a person looks
    (fake_run,) = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "kept")] == [0, 1, 2]


@pytest.mark.parametrize(
    "tamper, what",
    [
        ("UPDATE records SET metrics = '{\"loss\": 0.5' WHERE step = 1", "quarantined"),
        (
            "UPDATE records SET metrics = '{\"loss\": ' || replace(hex(zeroblob(100000)), '00', '[') WHERE step = 1",
            "quarantined",
        ),
        ("UPDATE records SET writer_id = 99 WHERE step = 1", "names no writer"),
        ("UPDATE records SET step = 'one' WHERE step = 1", "types walbuf does not write"),
    ],
    ids=["bad JSON", "deep nesting", "record of no writer", "step that is text"],
)
def test_malformed_content_in_an_older_walbufs_shard_is_refused_or_quarantined_never_a_traceback(
    server, tmp_path, tamper, what
):
    buffer = tmp_path / "exp"
    log(str(buffer) + "/", writer="kept")
    tampered = legacy_shard(buffer, HOST, "tampered", 3, sealed=True, metric="loss")
    with sqlite3.connect(tampered) as conn:
        conn.execute(tamper)
    conn.close()
    status = walbuf_command("status", buffer)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    proc = run_sync(server, buffer, quiet=False)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    assert what in proc.stderr
    (fake_run,) = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "kept")] == [0, 1, 2]
    assert walbuf_command("status", buffer).returncode == 0


# -- 4b. a log shard is untrusted input too ----------------------------------------------


def _frames():
    from walbuf.directory import frames

    return frames


@pytest.mark.parametrize(
    "tampered, what",
    [
        (lambda f: [f.frame(f.WRITER, b"{not json")], "is not one walbuf writes"),
        (lambda f: [f.record_frame(7, 0, 1.0, '{"loss": 1}')], "which the shard did not name before"),
        (
            lambda f: [
                writer_frame(1, "tampered"),
                f.json_frame(f.CONFIG, {"writer": 1, "kind": "config", "time": 1.0, "entries": {"lr": 3}}),
            ],
            "config entries that are not text",
        ),
        (lambda f: [writer_frame(1, "tampered", project="a/b")], "W&B refuses any of"),
        (lambda f: [writer_frame(1, "tampered", project="theirs")], "not 'theirs'"),
        (
            lambda f: [writer_frame(1, "tampered"), f.frame(f.RECORD, b"short")],
            "shorter than its fixed part",
        ),
    ],
    ids=[
        "writer not JSON",
        "record of no writer",
        "config not text",
        "target W&B refuses",
        "another target",
        "record cut short",
    ],
)
def test_a_log_shard_holding_what_walbuf_never_writes_is_reported_read_up_to_it_and_never_changed(
    server, tmp_path, tampered, what
):
    buffer = tmp_path / "exp"
    log(str(buffer) + "/", writer="kept", project="mine")
    f = _frames()
    before = [writer_frame(1, "early", project="mine"), f.record_frame(1, 0, 1.0, '{"loss": 1}')]
    shard = log_shard(buffer, "node2", [*before, *tampered(f), f.record_frame(1, 1, 2.0, '{"loss": 2}')])
    content = shard.read_bytes()
    status = walbuf_command("status", buffer)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    proc = run_sync(server, buffer, quiet=False)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    assert what in proc.stderr and str(shard) in proc.stderr
    (fake_run,) = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "kept")] == [0, 1, 2]
    assert [step for step, _ in rows_of(fake_run, "early")] == [0]  # what comes before it, and nothing after
    assert shard.read_bytes() == content
    assert walbuf_command("doctor", buffer).returncode == 1


def test_a_record_whose_metrics_are_not_json_in_a_log_shard_is_quarantined_and_the_rest_go_on(server, tmp_path):
    buffer = tmp_path / "exp"
    f = _frames()
    log_shard(
        buffer,
        "node2",
        [
            writer_frame(1, "w"),
            f.record_frame(1, 0, 1.0, '{"loss": 1}'),
            f.record_frame(1, 1, 2.0, '{"loss": '),
            f.record_frame(1, 2, 3.0, '{"loss": 3}'),
        ],
    )
    proc = run_sync(server, buffer, quiet=False)
    assert proc.returncode == 3 and "quarantined" in proc.stderr + proc.stdout, proc.stderr
    (fake_run,) = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "w")] == [0, 2]


def test_a_frame_declaring_a_body_over_the_bound_is_never_read(server, tmp_path):
    buffer = tmp_path / "exp"
    f = _frames()
    head = bytearray(f.frame(f.RECORD, b"x")[: f.HEAD_SIZE])
    head[4:8] = (f.MAX_BODY + 1).to_bytes(4, "little")
    shard = log_shard(
        buffer,
        "node2",
        [writer_frame(1, "w"), f.record_frame(1, 0, 1.0, "{}"), bytes(head) + b"x", f.record_frame(1, 1, 1.0, "{}")],
    )
    proc = run_sync(server, buffer, quiet=False)
    start = shard.read_bytes().index(bytes(head))
    assert proc.returncode == 3 and f"shard {shard} is damaged: bytes {start}-{start + len(head) + 1}" in proc.stderr
    (fake_run,) = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "w")] == [0, 1]  # the frame after it too


# -- 5 and 6. locks another account cannot hold or redirect -------------------------------


@pytest.mark.parametrize("lock", ["sync", "writer"])
def test_a_lock_file_planted_as_a_link_is_never_followed(server, shared_folders, cotenant, victim, lock):
    _, project = shared_folders
    buffer = project / "exp"
    log(str(buffer) + "/")
    writers = [p.name for p in (buffer / "locks").iterdir() if p.name.startswith("writer-")]
    name = "sync.lock" if lock == "sync" else writers[0]
    (buffer / "locks" / name).unlink(missing_ok=True)
    with opened_to_the_group(buffer, buffer / "locks", cotenant):
        plant(cotenant, f"ln -s {victim} {buffer}/locks/{name}")
    if lock == "sync":
        proc = cron(server, buffer)
        assert proc.returncode == 77 and "needs a person" in proc.stdout, proc.stdout
    else:
        with pytest.raises(walbuf.UntrustedPathError, match="is a symbolic link"):
            walbuf.init(str(buffer) + "/", writer="trainer", run="exp")
    assert victim.read_text() == VICTIM_TEXT


def test_the_cotenant_cannot_open_a_lock_file_to_hold_it(server, shared_folders, cotenant):
    _, project = shared_folders
    buffer = project / "exp"
    made_and_synced_at_umask_002(server, buffer)
    held = cotenant.run(f"flock --nonblock {buffer}/locks/sync.lock true")
    assert held.returncode != 0 and "Permission denied" in held.stderr
    log(str(buffer) + "/", writer="later")
    assert run_sync(server, buffer).returncode == 0


def test_a_lock_file_of_another_account_fails_the_cron_naming_it(server, shared_folders, cotenant):
    _, project = shared_folders
    buffer = project / "exp"
    log(str(buffer) + "/")
    (buffer / "locks" / "sync.lock").unlink(missing_ok=True)
    with opened_to_the_group(buffer, buffer / "locks", cotenant):
        plant(cotenant, f"touch {buffer}/locks/sync.lock")
    holder = subprocess.Popen(
        cotenant.command(["flock", str(buffer / "locks" / "sync.lock"), "-c", "echo held; read x"]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        proc = cron(server, buffer)
    finally:
        holder.stdin.close()
        holder.wait()
    assert proc.returncode == 77, proc.stdout
    assert "exit 77, needs a person" in proc.stdout and "belongs to walbuf-cotenant" in proc.stdout


# -- 8. other openings --------------------------------------------------------------------


def test_prune_never_acts_through_a_linked_ingested_folder(server, shared_folders, cotenant, tmp_path):
    _, project = shared_folders
    buffer = project / "exp"
    log(str(buffer) + "/")
    assert run_sync(server, buffer).returncode == 0
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / f"{HOST}.1.db").write_text("the owner's")
    for shard in (buffer / "ingested").iterdir():
        shard.rename(kept / shard.name)
    (buffer / "ingested").rmdir()
    with opened_to_the_group(buffer, buffer, cotenant):
        plant(cotenant, f"ln -s {kept} {buffer}/ingested")
    before = sorted(p.name for p in kept.iterdir())
    proc = walbuf_command("prune", buffer, "--older-than", "0s")
    assert proc.returncode == 77, proc.stderr
    assert "is a symbolic link" in proc.stderr
    assert sorted(p.name for p in kept.iterdir()) == before


def test_an_offline_sync_never_writes_through_a_linked_run_folder(shared_folders, cotenant, tmp_path):
    _, project = shared_folders
    buffer = project / "exp"
    log(str(buffer) + "/")
    documents = tmp_path / "documents"
    documents.mkdir()
    with opened_to_the_group(buffer, buffer, cotenant):
        plant(cotenant, f"ln -s {documents} {buffer}/hub.db.wandb")
    proc = walbuf_command("sync", buffer, "--mode", "offline")
    assert proc.returncode == 77, proc.stderr
    assert list(documents.iterdir()) == []


def test_a_wal_of_another_account_beside_a_buffer_is_never_read(shared_folders, cotenant):
    _, project = shared_folders
    buffer = project / "runs" / "exp.db"  # in a folder walbuf makes, owner-only
    live = walbuf.Writer(buffer, writer="trainer", run="exp")
    live.log({"loss": 0.5})
    try:
        wal = Path(f"{buffer}-wal")
        os.chown(wal, cotenant.uid, cotenant.gid)  # a -wal of another account (root swaps it in for the test)
        proc = walbuf_command("records", buffer)
    finally:
        os.chown(wal, 0, 0)
        live.close()
    assert proc.returncode == 77, proc.stderr
    assert "exp.db-wal belongs to walbuf-cotenant" in proc.stderr


def test_an_image_whose_png_is_larger_than_it_is_stored_is_quarantined_undecoded(server, tmp_path):
    pytest.importorskip("PIL")
    import numpy as np

    buffer = tmp_path / "exp.db"
    with walbuf.Writer(buffer, writer="trainer", run="exp") as w:
        w.log({"sample": walbuf.Image(np.zeros((1, 1), dtype=np.uint8))})
        w.log({"loss": 0.5})
    big = walbuf.Image(np.zeros((3000, 3000), dtype=np.uint8)).to_json()
    big.update(width=1, height=1)  # what the buffer claims, against what the PNG holds
    with sqlite3.connect(buffer) as conn:
        conn.execute("UPDATE records SET metrics = ? WHERE step = 0", (json.dumps({"sample": big}),))
    conn.close()
    proc = run_sync(server, buffer, quiet=False)
    assert proc.returncode == 3, proc.stderr
    assert "stored as 1x1 pixels, but its PNG is 3000x3000" in proc.stderr
    (fake_run,) = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "trainer")] == [1]


def test_the_cron_line_never_shows_a_database_password(tmp_path):
    command = Path(sys.executable).parent / "walbuf-cron"
    proc = subprocess.run(
        [str(command), "postgresql+psycopg://walbuf:s3cret-password@127.0.0.1:1/walbuf"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert "will retry" in proc.stdout, proc.stdout + proc.stderr
    assert "s3cret-password" not in proc.stdout + proc.stderr and "***" in proc.stdout


# -- found by the way ---------------------------------------------------------------------


def test_two_names_of_one_buffer_share_its_writer_locks(tmp_path):
    real = tmp_path / "real.db"
    log(real)
    (tmp_path / "link.db").symlink_to(real)
    with walbuf.Writer(real, writer="trainer", run="exp"):
        with pytest.raises(walbuf.WriterConflictError):
            walbuf.Writer(tmp_path / "link.db", writer="trainer", run="exp")


def test_two_names_of_one_buffer_share_its_sync_lock(server, tmp_path):
    real = tmp_path / "real.db"
    log(real)
    (tmp_path / "link.db").symlink_to(real)
    lock = walbuf.open_buffer(real).sync_lock()
    assert lock.acquire(timeout=0)
    try:
        proc = run_sync(server, tmp_path / "link.db")
    finally:
        lock.release()
    assert proc.returncode == 11, proc.stderr


@pytest.mark.parametrize("kind", ["directory", "sqlite"])
def test_a_writer_on_another_accounts_buffer_gets_a_clear_refusal_and_writes_nothing(tmp_path, cotenant, kind):
    buffer = tmp_path / ("theirs" if kind == "directory" else "theirs.db")
    location = str(buffer) + "/" if kind == "directory" else buffer
    log(location)
    subprocess.run(["chown", "-R", cotenant.name, str(buffer)], check=True)
    if kind == "sqlite":
        subprocess.run(["chown", "-R", cotenant.name, f"{buffer}.locks"], check=True)
    before = modes(tmp_path)
    with pytest.raises(walbuf.BufferNotWritableError, match="belongs to walbuf-cotenant"):
        walbuf.Writer(location, writer="mine", run="exp")
    assert modes(tmp_path) == before
    assert {r.writer for r in walbuf.read(location)} == {"trainer"}  # reading it is fine


# -- reading a shard is bounded: memory, time, signals ------------------------------------


def test_a_value_over_the_bound_in_an_older_walbufs_shard_is_never_read_and_the_shard_is_refused(server, tmp_path):
    buffer = tmp_path / "exp"
    log(str(buffer) + "/", writer="kept")
    huge = legacy_shard(buffer, HOST, "huge", 3, sealed=True)
    with sqlite3.connect(huge) as conn:  # 68 MB of text where a record's metrics go
        conn.execute("UPDATE records SET metrics = '{\"x\": \"' || hex(zeroblob(34000000)) || '\"}' WHERE step = 1")
    conn.close()
    proc = run_sync(server, buffer)
    assert proc.returncode == 3, proc.stderr
    assert "a value over 67,108,864 bytes" in proc.stderr
    assert huge.exists()
    (fake_run,) = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "kept")] == [0, 1, 2]


def test_a_sync_out_of_time_before_it_takes_in_a_shard_copies_nothing_and_the_next_sends_each_record_once(
    in_process, tmp_path
):
    buffer = tmp_path / "exp"
    log(str(buffer) + "/", n=5)
    # A bound of 1 s keeps all of it (at least 1 s) for wandb's finish, so the
    # budget is spent from its first look: nothing is taken in. (In this
    # process: a `walbuf sync` process would count its own start-up in the
    # bound, and a loaded machine could spend the second before the sync did.)
    result = walbuf.sync(str(buffer) + "/", max_seconds=1)
    assert result.stopped_early and result.runs == ()
    assert len(list((buffer / "sealed").iterdir())) == 1
    result = walbuf.sync(str(buffer) + "/")
    assert result.records == 5
    (fake_run,) = (in_process.run(r.target.wandb_id) for r in result.runs)
    assert [step for step, _ in rows_of(fake_run, "trainer")] == [0, 1, 2, 3, 4]


def test_a_sync_stopped_by_sigterm_while_it_takes_in_a_shard_exits_143_and_the_next_sends_each_record_once(
    server, tmp_path
):
    buffer = tmp_path / "exp"
    log(str(buffer) + "/", n=20_000)
    syncer = subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", str(buffer)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **server.env()},
    )
    for line in syncer.stderr:
        if "taking in shard" in line:
            break  # walbuf says so just before it opens the shard
    syncer.send_signal(subprocess.signal.SIGTERM)
    syncer.stderr.read()
    assert syncer.wait(timeout=120) == 143
    assert run_sync(server, buffer, timeout=300).returncode == 0
    (fake_run,) = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "trainer")] == list(range(20_000))
