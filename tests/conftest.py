"""Shared fixtures and helpers of the walbuf test suite."""

from __future__ import annotations

import grp
import json
import logging
import math
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

import walbuf

# A PostgreSQL database the tests may make schemas in (scripts/with-postgres
# starts a throwaway cluster and sets it). Each test's buffer is a schema of
# its own, dropped afterwards.
POSTGRES = os.environ.get("WALBUF_TEST_POSTGRES")


# Test modules that are slow as a whole (each marks itself so) and import a
# framework (torch and Lightning, Transformers, Accelerate) when collected.
FRAMEWORK_MODULES = {"test_lightning.py", "test_transformers.py", "test_accelerate.py", "test_side_by_side.py"}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The quick loop (-m "not slow") does not even import the framework modules: that alone took 5 s of it."""
    if collection_path.name in FRAMEWORK_MODULES and "not slow" in (config.getoption("markexpr") or ""):
        return True
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each test that takes a buffer once per backend its `backends` marker names."""
    if "backend" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("backends")
        names = marker.args if marker else ("sqlite",)
        metafunc.parametrize("backend", names, indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The kind of database the test's buffer is in: "sqlite" or "postgresql"."""
    name = request.param
    if name == "postgresql":
        require_postgres()
    return name


def require_postgres() -> None:
    """Skip the test when no PostgreSQL server was given (fail it in CI, where the PostgreSQL half never skips)."""
    if not POSTGRES:
        message = "no PostgreSQL: run the tests as scripts/with-postgres pytest"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


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
def in_process(wandb_session_server, tmp_path, monkeypatch):
    """A server for syncs run in this process (see wandb_session_server)."""
    for name, value in wandb_session_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    return wandb_session_server


@pytest.fixture
def server():
    """A fake W&B server of this test's own, for syncs run in other processes."""
    from wandb_server import FakeWandb

    with FakeWandb() as fake:
        yield fake


@contextmanager
def fresh_buffer(backend: str):
    """A buffer that does not exist yet, removed afterwards: a SQLite path, or a PostgreSQL URL with a new schema."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp) / "runs" / "exp.db"
        return
    schema = f"test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    try:
        yield f"{POSTGRES}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()


@pytest.fixture
def buffer(backend: str):
    """A buffer that does not exist yet (see fresh_buffer)."""
    with fresh_buffer(backend) as location:
        yield location


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the launcher variables of the shell that runs the suite."""
    for name in ("WALBUF_BUFFER", "WALBUF_WRITER", "WALBUF_RUN", "WALBUF_STEP_AXIS", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@contextmanager
def walbuf_says(text: str):
    """An Event that is set once walbuf logs a message containing ``text`` (it logs when it waits for a lock)."""
    event = threading.Event()

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                event.set()

    handler, logger = Handler(), logging.getLogger("walbuf")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield event
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


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


def by_writer(buffer: Path | str, run: str | None = None) -> dict[str, list[walbuf.Record]]:
    """The records in a buffer, grouped by writer, each group in logged order."""
    groups: dict[str, list[walbuf.Record]] = defaultdict(list)
    for record in walbuf.read(buffer, run=run):
        groups[record.writer].append(record)
    return dict(groups)


def record_count(buffer: Path | str) -> int:
    """Rows in the records table, read with plain SQLAlchemy (independent of walbuf's reader)."""
    if isinstance(buffer, Path) and not buffer.exists():
        return 0
    engine = sa.create_engine(buffer_url(buffer), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table("records"):
                return 0
            return conn.exec_driver_sql("SELECT count(*) FROM records").scalar()
    finally:
        engine.dispose()


def buffer_url(buffer: Path | str) -> str:
    """The SQLAlchemy URL of a test buffer, for opening it without walbuf."""
    return f"sqlite:///{buffer}" if isinstance(buffer, Path) else buffer


def run_sql(buffer: Path | str, statement: str, params: dict | None = None) -> list[tuple]:
    """Run one SQL statement on a buffer outside walbuf (committed); its rows, if any."""
    engine = sa.create_engine(buffer_url(buffer), poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            result = conn.execute(sa.text(statement), params or {})
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        engine.dispose()


def buffer_exists(buffer: Path | str) -> bool:
    """Whether walbuf made a buffer there: the SQLite file, or walbuf's tables in the schema."""
    if isinstance(buffer, Path):
        return buffer.exists()
    engine = sa.create_engine(buffer, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return sa.inspect(conn).has_table("alembic_version")
    finally:
        engine.dispose()


def walbuf_command(*args, env=None, timeout=120):
    """`walbuf ARGS` in its own process, as a user runs it (``env`` added to this one's environment)."""
    return subprocess.run(
        [sys.executable, "-m", "walbuf", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def run_status(buffer):
    """`walbuf status --json` of ``buffer``, parsed."""
    proc = walbuf_command("status", str(buffer), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def the_run(server, buffer=None, run=None):
    """The W&B run the fake server holds: its only one; or, given a buffer, the one walbuf run ``run`` (the buffer's
    only run if None) was synced into."""
    if buffer is None:
        (fake_run,) = server.runs.values()
        return fake_run
    listed = json.loads(walbuf_command("status", "--json", buffer).stdout)["runs"]
    (wandb_id,) = [r["wandb_id"] for r in listed if run is None or r["run"] == run]
    return server.run(wandb_id)


def run_sync(server, buffer, *args, timeout=120, env=None, quiet=True, prefix=()):
    """`walbuf sync BUFFER ARGS` in its own process, as cron would run it (with --quiet unless told).

    ``prefix`` is a command that runs it (one that sets a fault up, say).
    """
    full_env = {**os.environ, **server.env(), **(env or {})}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "walbuf", "sync", str(buffer), *(["--quiet"] if quiet else []), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def rows_of(fake_run, writer, axis="step"):
    """(step, metrics without the writer prefix) of one writer's rows, in arrival order."""
    prefix = writer + "/"
    out = []
    for row in fake_run.history:
        if prefix + axis not in row:
            continue
        metrics = {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix) and k != prefix + axis}
        out.append((row[prefix + axis], metrics))
    return out


def as_reader(command: list[str]) -> list[str]:
    """``command`` run by a process that may read the buffer's files but not write them.

    Not root: the files' modes (a-w) stop writes. Root ignores modes through
    CAP_DAC_OVERRIDE; the command then runs with that capability (and
    CAP_DAC_READ_SEARCH, CAP_FOWNER) dropped from its bounding set by
    setpriv(1): still uid 0 and the files' owner, now bound by their modes
    like any owner. (subprocess's user="nobody" cannot work here: the venv's
    interpreter is a symlink into /root, which nobody may not enter.)
    """
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv(1) (util-linux): cannot drop CAP_DAC_OVERRIDE")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner", *command]


# -- a second account, for what another user of shared storage can do --------------------

COTENANT = "walbuf-cotenant"
PROJECT_GROUP = "walbuf-project"


@dataclass(frozen=True)
class Account:
    """Another account of this machine, in a project group with the suite's own (root)."""

    name: str
    uid: int
    gid: int
    group: int  # the project group's id

    def command(self, command: list[str]) -> list[str]:
        """``command`` run as this account, with none of root's capabilities (setpriv(1))."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", f"--groups={self.group}", "--", *command]

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        """A shell script run as this account (its tools are /bin's: /root, and with it Python, it cannot enter)."""
        return subprocess.run(self.command(["/bin/sh", "-c", script]), capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="session")
def cotenant() -> Account:
    """A second account (made if missing), as a co-tenant of a group project directory or of scratch.

    Only root can make one: a run that is not root fails in CI and skips
    elsewhere, saying so.
    """
    missing = [tool for tool in ("setpriv", "useradd", "groupadd") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        message = "the shared-storage tests need a second account, which only a suite run as root can make" + (
            f" (and {', '.join(missing)})" if missing else ""
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    subprocess.run(["groupadd", "-f", PROJECT_GROUP], check=True)
    try:
        pwd.getpwnam(COTENANT)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", PROJECT_GROUP, COTENANT],
            check=True,
        )
    account = pwd.getpwnam(COTENANT)
    return Account(COTENANT, account.pw_uid, account.pw_gid, grp.getgrnam(PROJECT_GROUP).gr_gid)


@pytest.fixture
def shared_folders(cotenant):
    """(scratch, project): a world-writable scratch folder (1777) and a group project folder (2770, the project
    group's)."""
    top = Path(tempfile.mkdtemp(prefix="walbuf-shared-", dir="/tmp"))
    top.chmod(0o755)
    scratch, project = top / "scratch", top / "project"
    scratch.mkdir()
    scratch.chmod(0o1777)
    project.mkdir()
    os.chown(project, 0, cotenant.group)
    project.chmod(0o2770)
    try:
        yield scratch, project
    finally:
        shutil.rmtree(top)


@pytest.fixture
def limited_database():
    """A URL of a new database whose role may hold 2 connections at once (superusers have no such limit)."""
    require_postgres()
    assert POSTGRES is not None
    name = f"limited_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {name} LOGIN CONNECTION LIMIT 2")
        conn.exec_driver_sql(f"CREATE DATABASE {name} OWNER {name}")
    try:
        yield sa.make_url(POSTGRES).set(username=name, database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE {name} WITH (FORCE)")
            conn.exec_driver_sql(f"DROP ROLE {name}")
        admin.dispose()


def wandb_cores(pid: int) -> set[int]:
    """The wandb-core processes that process ``pid`` started (their pids)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        for child in children:
            try:
                if b"wandb-core" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.add(int(child))
            except FileNotFoundError:  # a child that ended meanwhile
                continue
    return found


@pytest.fixture
def unused_port():
    """A TCP port on 127.0.0.1 that refuses connections: bound for the test, never listened on (so nothing else takes
    it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def legacy_shard(directory, host, writer, n, *, sealed=False, project=None, metric="i"):
    """A SQLite shard as walbuf wrote them before log shards, of ``writer`` with ``n`` records; its path.

    Live (``live/HOST/GEN.db``, WAL), or as that walbuf sealed it
    (``sealed/HOST.GEN.db``, rollback journal). Records hold {metric: i}.
    """
    import json
    import time

    from walbuf.directory.layout import Layout
    from walbuf.store import Storage, Target
    from walbuf.store.sqlite import SQLiteBackend

    layout = Layout(Path(directory))
    layout.make()
    gen = time.time_ns()
    path = layout.live(host) / f"{gen:020d}.db"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    with Storage(SQLiteBackend(path, locks=layout.locks, owner=layout.owner), access="create") as shard:
        pk, _ = shard.register_writer("exp", writer, "step", writer, host, os.getpid(), Target(None, project, None))
        appender = shard.appender()
        for i in range(n):
            appender.append((pk, i, time.time(), json.dumps({metric: i})))
        appender.close()
        shard.mark_closed(pk)
    if not sealed:
        return path
    import sqlite3

    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    target = layout.sealed / f"{host}.{gen}.db"
    layout.sealed.mkdir(exist_ok=True)
    os.replace(path, target)
    return target


def log_shard(directory, host, frames, *, state="sealed"):
    """A log shard of frames as given (bytes of walbuf.directory.frames), after a process frame of this process.

    In sealed/ (HOST.GEN.log) or live/HOST/ (GEN.log); its path.
    """
    import time

    from walbuf.directory import frames as f
    from walbuf.directory.host import Process
    from walbuf.directory.layout import Layout

    layout = Layout(Path(directory))
    layout.make()
    gen = time.time_ns()
    if state == "sealed":
        layout.sealed.mkdir(exist_ok=True)
        path = layout.sealed / f"{host}.{gen}.log"
    else:
        layout.live(host).mkdir(mode=0o700, exist_ok=True)
        path = layout.live(host) / f"{gen:020d}.log"
    start = f.json_frame(f.PROCESS, {"format": 1, "process": Process.this(host).to_json(), "time": time.time()})
    path.write_bytes(start + b"".join(frames))
    path.chmod(0o600)
    return path


def writer_frame(local, name, run="exp", project=None):
    """A frame that opens writer ``name`` under ``local`` in a log shard (see log_shard)."""
    import time

    from walbuf.directory import frames as f

    return f.json_frame(
        f.WRITER,
        {
            "id": local,
            "run": run,
            "name": name,
            "step_axis": "step",
            "prefix": name,
            "host": "node",
            "pid": 1,
            "target": [None, project, None],
            "time": time.time(),
        },
    )


def require_strace() -> str:
    """strace's path: a test that injects faults with it fails in CI without it, and is skipped elsewhere."""
    strace = shutil.which("strace")
    if strace is None:
        message = "strace is missing: apt-get install strace"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return strace


def until(condition: Callable[[], bool], what: str, bound: float = 120.0) -> None:
    """Look until ``condition()`` holds (an event in /proc, a line in a trace); fail the test if it does not within
    ``bound`` seconds (a bound, not a pace)."""
    gave_up = threading.Event()
    timer = threading.Timer(bound, gave_up.set)
    timer.start()
    try:
        while not condition():
            assert not gave_up.is_set(), what
    finally:
        timer.cancel()


def stopped_by_strace(trace: Path, what: str) -> int:
    """Wait until strace's trace (-o ``trace``) says its tracee stopped (an injected SIGSTOP); the tracee's pid
    (strace's first line is its main thread's). Fails the test with ``what`` if it never does."""
    until(lambda: trace.exists() and "stopped by SIGSTOP" in trace.read_text(), what)
    return int(trace.read_text().split()[0])
