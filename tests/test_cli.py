"""The walbuf command: output, errors as one line, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

import walbuf
from walbuf.cli import main


def test_records_prints_json_lines_in_logged_order(buffer):
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"a": 1, "b": float("nan")})
        w.log({"a": 2}, step=5)
    result = CliRunner().invoke(main, ["records", str(buffer)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [(r["run"], r["writer"], r["step"], r["metrics"]["a"]) for r in lines] == [("r", "w", 0, 1), ("r", "w", 5, 2)]


def test_records_limit_and_filters(buffer):
    with walbuf.Writer(buffer, writer="a") as a, walbuf.Writer(buffer, writer="b") as b:
        for i in range(3):
            a.log({"i": i})
            b.log({"i": i})
    result = CliRunner().invoke(main, ["records", str(buffer), "--writer", "b", "--limit", "2"])
    assert [json.loads(line)["writer"] for line in result.output.splitlines()] == ["b", "b"]


def test_missing_buffer_is_one_line_and_exit_66(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "records", str(tmp_path / "nope.db")], capture_output=True, text=True
    )
    assert proc.returncode == 66
    assert proc.stderr.strip().count("\n") == 0 and "no buffer at" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_corrupt_buffer_exits_65(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"garbage" * 200)
    result = CliRunner().invoke(main, ["records", str(bad)])
    assert result.exit_code == 65
    assert "not a readable walbuf buffer" in result.output


def test_help_lists_exit_codes():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "66  buffer does not exist" in result.output


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert walbuf.__version__ in result.output
