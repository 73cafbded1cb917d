"""The walbuf command: output, errors as one line, exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import walbuf_command

import walbuf
from walbuf import exitcodes
from walbuf.cli import main


def test_records_prints_json_lines_in_logged_order(buffer):
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"a": 1, "b": float("nan")})
        w.log({"a": 2}, step=5)
    result = CliRunner().invoke(main, ["records", str(buffer)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [(r["run"], r["writer"], r["step"], r["metrics"]["a"]) for r in lines] == [
        ("r", "w", 0, 1),
        ("r", "w", 5, 2),
    ]


def test_records_limit_and_filters(buffer):
    with walbuf.Writer(buffer, writer="a") as a, walbuf.Writer(buffer, writer="b") as b:
        for i in range(3):
            a.log({"i": i})
            b.log({"i": i})
    result = CliRunner().invoke(main, ["records", str(buffer), "--writer", "b", "--limit", "2"])
    assert [json.loads(line)["writer"] for line in result.output.splitlines()] == ["b", "b"]


def test_records_of_a_writer_the_buffer_lacks_says_so_naming_those_it_has(buffer):
    with walbuf.Writer(buffer, writer="rank-0", run="exp1") as w:
        w.log({"i": 0})
    result = CliRunner().invoke(main, ["records", str(buffer), "--writer", "rank0"])
    assert result.exit_code == 78
    assert result.output.strip().endswith("no writer 'rank0' in " + str(buffer) + "; writers: 'rank-0'")


def test_records_of_a_run_the_buffer_lacks_says_so_naming_those_it_has(buffer):
    with walbuf.Writer(buffer, writer="w", run="exp1") as w:
        w.log({"i": 0})
    result = CliRunner().invoke(main, ["records", str(buffer), "--run", "exp"])
    assert result.exit_code == 78 and "no run 'exp' in" in result.output and "runs: 'exp1'" in result.output


def test_missing_buffer_is_one_line_and_exit_66(tmp_path):
    proc = walbuf_command("records", str(tmp_path / "nope.db"))
    assert proc.returncode == 66
    assert proc.stderr.strip().count("\n") == 0 and "no buffer at" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_corrupt_buffer_exits_65(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"garbage" * 200)
    result = CliRunner().invoke(main, ["records", str(bad)])
    assert result.exit_code == 65
    assert "not a readable walbuf buffer" in result.output


def test_help_lists_every_exit_code():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    listed = re.findall(r"^ +(\d+) ", result.output.split("Exit codes:")[1], re.MULTILINE)
    assert listed == [str(c.code) for c in exitcodes.EXIT_CODES]
    assert "66  the buffer does not exist" in result.output


@pytest.mark.parametrize("command", ["records", "status", "doctor", "prune"])
def test_help_of_a_command_that_does_not_sync_lists_no_code_of_a_sync(command):
    result = CliRunner().invoke(main, [command, "--help"])
    listed = re.findall(r"^ +(\d+) ", result.output.split("Exit codes:")[1], re.MULTILINE)
    assert "66" in listed and "77" in listed
    assert not {"3", "11", "75"} & set(listed)  # quarantine, another sync, W&B


def test_readme_lists_the_exit_codes_the_command_has():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert exitcodes.markdown_table() in readme


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert walbuf.__version__ in result.output


def walbuf_cron(buffer, env):
    """The installed walbuf-cron, run as cron runs it: by its full path, with cron's bare PATH."""
    command = Path(sys.executable).parent / "walbuf-cron"
    return subprocess.run(
        [str(command), str(buffer)], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True
    )


@pytest.mark.slow
def test_walbuf_cron_runs_with_crons_bare_path_and_logs_one_line(server, tmp_path):
    with walbuf.Writer(tmp_path / "b.db", writer="w") as w:
        for i in range(3):
            w.log({"i": i})
    proc = walbuf_cron(tmp_path / "b.db", {"HOME": str(tmp_path), **server.env()})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and "ok, 3 records synced" in proc.stdout


def test_walbuf_cron_logs_what_a_retry_fixes_and_exits_0(tmp_path):
    buffer = tmp_path / "b.db"
    walbuf.Writer(buffer, writer="w").close()
    holder = walbuf.open_buffer(buffer).sync_lock()
    assert holder.acquire(timeout=0)
    try:
        proc = walbuf_cron(buffer, {"HOME": str(tmp_path)})
    finally:
        holder.release()
    assert proc.returncode == 0
    assert proc.stdout.count("\n") == 1 and "exit 11, will retry: another walbuf sync" in proc.stdout


@pytest.mark.slow
def test_walbuf_cron_logs_w_and_b_down_as_will_retry_and_exits_0(server, tmp_path):
    with walbuf.Writer(tmp_path / "b.db", writer="w") as w:
        w.log({"i": 0})
    server.go_down()
    proc = walbuf_cron(tmp_path / "b.db", {"HOME": str(tmp_path), **server.env()})
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("\n") == 1 and "exit 75, will retry" in proc.stdout


def test_walbuf_cron_logs_an_unreachable_postgresql_server_as_will_retry_and_exits_0(tmp_path, unused_port):
    proc = walbuf_cron(f"postgresql+psycopg://walbuf@127.0.0.1:{unused_port}/walbuf", {"HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("\n") == 1 and "exit 69, will retry" in proc.stdout


def test_an_error_quoting_a_message_of_several_lines_is_one_line(tmp_path, unused_port):
    proc = walbuf_command("status", f"postgresql+psycopg://walbuf@127.0.0.1:{unused_port}/walbuf")
    assert proc.returncode == 69
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("walbuf: error: cannot reach"), proc.stderr


def test_walbuf_cron_keeps_the_code_of_what_needs_a_person(tmp_path):
    proc = walbuf_cron(tmp_path / "nope.db", {"HOME": str(tmp_path)})
    assert proc.returncode == 66
    assert proc.stdout.count("\n") == 1 and "exit 66, needs a person: no buffer at" in proc.stdout


def test_a_buffer_url_that_holds_a_password_gets_a_warning_that_never_shows_it():
    proc = walbuf_command("status", "postgresql+psycopg://alice:hunter2@127.0.0.1:1/exp")
    assert proc.returncode == 69, proc.stderr  # the server is not there
    assert "the buffer's URL holds a password" in proc.stderr and "~/.pgpass" in proc.stderr
    assert "hunter2" not in proc.stderr + proc.stdout


# A Ctrl-C or SIGTERM can arrive while SQLAlchemy closes a connection (a
# follow closes its own between passes), which SQLAlchemy logs with a
# traceback before raising it again. Here the connection's close() is
# interrupted at once, in a process that ran a walbuf command first.
INTERRUPTED_WHILE_CLOSING = """
import sqlite3, sys
import sqlalchemy as sa
from walbuf.cli import main

class InterruptedOnClose(sqlite3.Connection):
    def close(self):
        super().close()
        raise KeyboardInterrupt

try:
    main(["status", sys.argv[1]])
except SystemExit:
    pass
engine = sa.create_engine("sqlite://", creator=lambda: sqlite3.connect(":memory:", factory=InterruptedOnClose))
engine.connect().close()
try:
    engine.dispose()
except KeyboardInterrupt:
    print("interrupted")
"""


def test_an_interruption_while_sqlalchemy_closes_a_connection_shows_no_traceback(buffer):
    walbuf.Writer(buffer, writer="w", run="exp").close()
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_WHILE_CLOSING, str(buffer)], capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.splitlines()[-1] == "interrupted"
    assert proc.stderr == ""
