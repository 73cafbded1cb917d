"""Shared fixtures and helpers of the walbuf test suite."""

from __future__ import annotations

import math
import sqlite3
from collections import defaultdict
from pathlib import Path

import pytest

import walbuf


@pytest.fixture(scope="session")
def wandb_session_server():
    """The fake W&B server for syncs run inside the test process.

    wandb reads its settings (WANDB_BASE_URL) once per process, so every
    in-process sync of the session must talk to this one server.
    """
    from wandb_server import FakeWandb

    with FakeWandb() as fake:
        yield fake


@pytest.fixture
def buffer(tmp_path: Path) -> Path:
    """Path of a buffer that does not exist yet."""
    return tmp_path / "runs" / "exp.db"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the launcher variables of the shell that runs the suite."""
    for name in ("WALBUF_BUFFER", "WALBUF_WRITER", "WALBUF_RUN", "WALBUF_STEP_AXIS", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def same_value(a: object, b: object) -> bool:
    """Exact equality: NaN equals NaN, -0.0 differs from 0.0, bool differs from int."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        assert isinstance(b, float)
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


def same_metrics(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)


def by_writer(buffer: Path, run: str | None = None) -> dict[str, list[walbuf.Record]]:
    """The records in a buffer, grouped by writer, each group in logged order."""
    groups: dict[str, list[walbuf.Record]] = defaultdict(list)
    for record in walbuf.read(buffer, run=run):
        groups[record.writer].append(record)
    return dict(groups)


def record_count(buffer: Path) -> int:
    """Rows in the records table, read with plain sqlite3 (independent of walbuf's reader)."""
    if not buffer.exists():
        return 0
    with sqlite3.connect(buffer) as conn:
        return conn.execute("SELECT count(*) FROM records").fetchone()[0]
