"""The Writer in one process: steps, settings, ownership of a writer id, lifecycle."""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import threading

import pytest
from conftest import buffer_exists, by_writer, record_count, run_sql, walbuf_says

import walbuf

pytestmark = pytest.mark.backends("sqlite", "postgresql")


def steps(buffer, writer=None):
    return [r.step for r in walbuf.read(buffer, writer=writer)]


def test_steps_auto_increment_from_zero(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        assert [w.log({"a": i}) for i in range(3)] == [0, 1, 2]
    assert steps(buffer) == [0, 1, 2]


def test_explicit_step_is_kept_and_auto_step_continues_after_it(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"a": 1})
        assert w.log({"a": 2}, step=12) == 12
        assert w.log({"a": 3}) == 13
    assert steps(buffer) == [0, 12, 13]


def test_same_explicit_step_twice_adds_a_second_record_at_that_step(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"loss": 1.0}, step=5)
        w.log({"lr": 0.1}, step=5)
    assert steps(buffer) == [5, 5]


def test_step_going_backwards_raises_value_error_and_writes_nothing(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"a": 1}, step=10)
        with pytest.raises(ValueError, match="goes backwards"):
            w.log({"a": 2}, step=9)
        assert w.last_step == 10
        assert w.log({"a": 3}) == 11
    assert steps(buffer) == [10, 11]


@pytest.mark.parametrize("step", [True, 1.0, "3", [1]])
def test_step_that_is_not_an_int_is_refused(buffer, step):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(TypeError, match="step must be an int"):
            w.log({"a": 1}, step=step)
    assert record_count(buffer) == 0


@pytest.mark.parametrize("step", [-1, 2**63])
def test_step_out_of_range_is_refused(buffer, step):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(ValueError, match="between 0 and"):
            w.log({"a": 1}, step=step)
    assert record_count(buffer) == 0


def test_numpy_int_step_is_accepted(buffer):
    np = pytest.importorskip("numpy")
    with walbuf.Writer(buffer, writer="w") as w:
        assert w.log({"a": 1}, step=np.int64(4)) == 4


def test_reopened_writer_continues_from_its_last_step(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"a": 1}, step=41)
    with walbuf.Writer(buffer, writer="w") as w:
        assert w.last_step == 41
        with pytest.raises(ValueError):
            w.log({"a": 1}, step=40)
        assert w.log({"a": 2}) == 42


def test_writers_have_independent_steps(buffer):
    with walbuf.Writer(buffer, writer="a") as a, walbuf.Writer(buffer, writer="b") as b:
        a.log({"x": 1}, step=100)
        assert b.log({"x": 1}) == 0
    assert {w: [r.step for r in rs] for w, rs in by_writer(buffer).items()} == {"a": [100], "b": [0]}


def test_record_carries_run_writer_and_wall_clock_time(buffer):
    import time

    before = time.time()
    with walbuf.Writer(buffer, writer="eval-3", run="exp1") as w:
        w.log({"a": 1})
    (record,) = walbuf.read(buffer)
    assert (record.run, record.writer) == ("exp1", "eval-3")
    assert before <= record.time <= time.time()


def test_second_live_writer_with_the_same_id_in_the_same_run_is_refused(buffer):
    with walbuf.Writer(buffer, writer="w", run="r"):
        with pytest.raises(walbuf.WriterConflictError, match=f"process {os.getpid()}"):
            walbuf.Writer(buffer, writer="w", run="r")


def test_same_writer_id_in_another_run_is_another_writer(buffer):
    with walbuf.Writer(buffer, writer="w", run="r1"), walbuf.Writer(buffer, writer="w", run="r2"):
        pass


def test_writer_id_is_free_again_after_close(buffer):
    walbuf.Writer(buffer, writer="w").close()
    walbuf.Writer(buffer, writer="w").close()


def test_wait_lets_a_writer_take_over_an_id_when_its_holder_closes(buffer):
    holder = walbuf.Writer(buffer, writer="w")
    opened = []

    def successor():
        with walbuf.Writer(buffer, writer="w", wait=60) as w:
            opened.append(w.log({"a": 1}))

    with walbuf_says("'w' of run 'default' is open elsewhere; waiting up to 60s") as waits:
        thread = threading.Thread(target=successor)
        thread.start()
        assert waits.wait(timeout=60)  # it found the id taken, and waits
        assert opened == []
        holder.close()
        thread.join()
    assert opened == [0]


def test_existing_writer_with_another_step_axis_is_refused(buffer):
    walbuf.Writer(buffer, writer="w", step_axis="train_step").close()
    with pytest.raises(walbuf.WriterConflictError, match="'train_step'"):
        walbuf.Writer(buffer, writer="w", step_axis="eval_step")


def test_log_after_close_raises(buffer):
    w = walbuf.Writer(buffer, writer="w")
    w.close()
    with pytest.raises(walbuf.WriterClosedError):
        w.log({"a": 1})


def test_close_is_idempotent_and_context_manager_closes(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        pass
    assert w.closed
    w.close()


def test_threads_sharing_a_writer_get_distinct_consecutive_steps(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        threads = [threading.Thread(target=lambda: [w.log({"a": 1}) for _ in range(200)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert steps(buffer) == list(range(800))


def test_flush_leaves_records_readable(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"a": 1})
        w.flush()
    assert steps(buffer) == [0]


@pytest.mark.backends("sqlite")
def test_buffer_is_in_wal_mode(buffer):
    walbuf.Writer(buffer, writer="w").close()
    with sqlite3.connect(buffer) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.backends("sqlite")
@pytest.mark.parametrize("durability, level", [("normal", 1), ("fsync", 2)])
def test_durability_sets_sqlite_synchronous(buffer, durability, level):
    with walbuf.Writer(buffer, writer="w", durability=durability) as w:
        assert w._open.segment.appender._cursor.connection.execute("PRAGMA synchronous").fetchone()[0] == level


@pytest.mark.backends("postgresql")
@pytest.mark.parametrize("durability, level", [("normal", "off"), ("fsync", "on")])
def test_durability_sets_postgresql_synchronous_commit(buffer, durability, level):
    with walbuf.Writer(buffer, writer="w", durability=durability) as w:
        assert w._open.segment.appender.connection.execute("SHOW synchronous_commit").fetchone()[0] == level


def test_unknown_durability_is_refused(buffer):
    with pytest.raises(walbuf.ConfigError, match="durability"):
        walbuf.Writer(buffer, writer="w", durability="paranoid")
    assert not buffer_exists(buffer)


@pytest.mark.parametrize("wait", [-1, float("inf"), float("nan"), True, "5"])
def test_a_wait_that_is_not_seconds_is_refused_naming_it(buffer, wait):
    with pytest.raises(walbuf.ConfigError, match="wait must be a finite number of seconds >= 0"):
        walbuf.Writer(buffer, writer="w", wait=wait)
    assert not buffer_exists(buffer)


def test_missing_parent_directories_are_created(tmp_path):
    deep = tmp_path / "a" / "b" / "c.db"
    walbuf.Writer(deep, writer="w").close()
    assert deep.exists()


@pytest.mark.backends("sqlite")
def test_sqlite_url_is_accepted(buffer):
    buffer.parent.mkdir(parents=True)
    walbuf.Writer(f"sqlite:///{buffer}", writer="w").close()
    assert buffer.exists()


@pytest.mark.parametrize(
    "url, message",
    [
        ("", "no buffer given"),
        ("sqlite://", "in-memory"),
        ("sqlite:///:memory:", "in-memory"),
        ("mysql://u@h/db", "SQLite"),
        ("not a url://x", "not a valid"),
    ],
)
def test_unusable_buffer_is_a_config_error(url, message):
    with pytest.raises(walbuf.ConfigError, match=message):
        walbuf.Writer(url, writer="w")


@pytest.mark.parametrize("setting", ["writer", "run", "step_axis"])
def test_empty_settings_are_refused(buffer, setting):
    with pytest.raises(walbuf.ConfigError, match=setting):
        walbuf.Writer(buffer, **{"writer": "w", setting: ""})


def test_settings_default_from_the_environment(buffer, monkeypatch):
    monkeypatch.setenv("WALBUF_BUFFER", str(buffer))
    monkeypatch.setenv("WALBUF_WRITER", "from-env")
    monkeypatch.setenv("WALBUF_RUN", "env-run")
    monkeypatch.setenv("WALBUF_STEP_AXIS", "env_step")
    with walbuf.Writer() as w:
        assert (w.writer, w.run, w.step_axis) == ("from-env", "env-run", "env_step")
        w.log({"a": 1})
    (record,) = walbuf.read(buffer)
    assert (record.run, record.writer) == ("env-run", "from-env")


def test_arguments_win_over_the_environment(buffer, monkeypatch):
    monkeypatch.setenv("WALBUF_WRITER", "from-env")
    with walbuf.Writer(buffer, writer="given") as w:
        assert w.writer == "given"


def test_default_writer_id_is_host_and_pid(buffer):
    with walbuf.Writer(buffer) as w:
        assert w.writer == f"{socket.gethostname()}-{os.getpid()}"
        assert w.step_axis == "step"
        assert w.run == "default"


def test_default_writer_id_follows_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert walbuf.default_writer_id() == "rank-3"


def test_default_writer_id_follows_local_rank_with_the_host(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert walbuf.default_writer_id() == f"{socket.gethostname()}-rank-1"


class TestModuleLevel:
    def test_log_goes_to_the_writer_init_made(self, buffer):
        w = walbuf.init(buffer, writer="w")
        try:
            assert walbuf.log({"a": 1}) == 0
            assert walbuf.log({"a": 2}, step=5) == 5
        finally:
            w.close()
        assert steps(buffer) == [0, 5]

    def test_log_without_init_says_to_call_init(self, monkeypatch):
        monkeypatch.setattr(walbuf.writer, "_default", None)
        with pytest.raises(walbuf.NoWriterError, match="walbuf.init"):
            walbuf.log({"a": 1})

    def test_init_again_for_the_same_writer_closes_the_first_and_opens_it_anew(self, buffer):
        first = walbuf.init(buffer, writer="w")
        first.log({"a": 1})
        second = walbuf.init(buffer, writer="w")  # a notebook cell run twice
        try:
            assert first.closed and not second.closed
            assert walbuf.log({"a": 2}) == 1
        finally:
            second.close()

    def test_init_for_another_writer_while_the_first_is_open_says_to_use_writer(self, buffer):
        first = walbuf.init(buffer, writer="train")
        try:
            with pytest.raises(walbuf.ConfigError, match=r"open it with walbuf.Writer\(...\)"):
                walbuf.init(buffer, writer="eval")
            assert not first.closed and walbuf.log({"a": 1}) == 0  # the first goes on
            with walbuf.Writer(buffer, writer="eval") as other:  # what the message says to do
                assert other.log({"b": 1}) == 0
        finally:
            first.close()
        walbuf.init(buffer, writer="eval").close()  # once the first is closed, init may open another

    def test_a_closed_writer_says_how_to_open_it_again(self, buffer):
        w = walbuf.Writer(buffer, writer="w", run="r")
        w.close()
        with pytest.raises(walbuf.WriterClosedError, match=r"'w' of run 'r' is closed; open it again \(walbuf.Writer"):
            w.log({"a": 1})


def test_writer_id_with_a_slash_is_refused(buffer):
    with pytest.raises(walbuf.ConfigError, match="'/'"):
        walbuf.Writer(buffer, writer="rank/0")
    assert record_count(buffer) == 0


def test_wandb_target_given_to_init_is_stored_for_the_run(buffer):
    with walbuf.Writer(buffer, writer="w", run="exp1", project="p", entity="e", run_id="abc123"):
        pass
    rows = run_sql(buffer, "SELECT wandb_id, project, entity FROM runs WHERE name = 'exp1'")
    assert rows == [("abc123", "p", "e")]


def test_target_that_conflicts_with_the_stored_one_is_refused(buffer):
    walbuf.Writer(buffer, writer="w", run="exp1", project="p").close()
    walbuf.Writer(buffer, writer="w2", run="exp1").close()  # leaving it out uses the stored one
    with pytest.raises(walbuf.TargetConflictError, match="project 'p', not 'q'"):
        walbuf.Writer(buffer, writer="w3", run="exp1", project="q")


@pytest.mark.parametrize("settings", [{"writer": "rank*"}, {"writer": "w", "step_axis": "s*"}])
def test_writer_id_or_axis_with_a_wildcard_is_refused(buffer, settings):
    with pytest.raises(walbuf.ConfigError, match=r"\*"):
        walbuf.Writer(buffer, **settings)


def test_an_axis_value_is_kept_under_the_step_axis_name_and_the_step_counts_on(buffer):
    with walbuf.Writer(buffer, writer="w", step_axis="global_step") as w:
        assert w.log({"loss": 0.5}, axis=6) == 0
        assert w.log({"loss": 0.4}, axis=5) == 1  # the axis may go back; the step never does
    assert [(r.step, r.metrics) for r in walbuf.read(buffer)] == [
        (0, {"loss": 0.5, "global_step": 6}),
        (1, {"loss": 0.4, "global_step": 5}),
    ]


@pytest.mark.parametrize(
    "axis, error", [(-1, walbuf.StepOrderError), (1.5, walbuf.ArgumentTypeError), (True, walbuf.ArgumentTypeError)]
)
def test_an_axis_value_that_is_not_an_int_of_zero_or_more_is_refused_and_nothing_is_written(buffer, axis, error):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(error, match="axis"):
            w.log({"loss": 0.5}, axis=axis)
    assert list(walbuf.read(buffer)) == []


@pytest.mark.parametrize(
    "setting, value",
    [
        ("writer", "w\x00"),
        ("writer", " "),
        ("run", "a\nb"),
        ("run", "  "),
        ("step_axis", "s\tep"),
        ("writer", "\ud800"),
        ("writer", " rank-0"),
        ("run", "exp1 "),
    ],
    ids=[
        "writer with NUL",
        "blank writer",
        "run with newline",
        "blank run",
        "axis with tab",
        "writer with surrogate",
        "writer with a leading space",
        "run with a trailing space",
    ],
)
def test_a_name_w_and_b_would_get_changed_is_refused_when_the_writer_opens(buffer, backend, setting, value):
    with pytest.raises(walbuf.ConfigError, match="W&B would get it changed"):
        walbuf.Writer(buffer, **{"writer": "w", setting: value})
    assert not buffer_exists(buffer)


def test_a_record_of_no_metric_is_refused_and_takes_no_step(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"i": 0})
        for empty in ({}, {"eval": {}}):
            with pytest.raises(walbuf.MetricValueError, match="at least one metric"):
                w.log(empty)
        assert w.log({"i": 1}) == 1
    assert [r.step for r in walbuf.read(buffer)] == [0, 1]


@pytest.mark.backends("postgresql")
def test_a_writer_whose_session_the_server_ended_logs_on_over_a_new_connection(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"i": 0})
        session = w._open.segment.appender.connection.info.backend_pid
        run_sql(buffer, f"SELECT pg_terminate_backend({session})")
        with contextlib.suppress(walbuf.StorageError):
            w.log({"i": 1})  # sent down the ended session: it fails
        assert w.log({"i": 2}) > 0
    assert [r.metrics["i"] for r in walbuf.read(buffer)][-1] == 2


@pytest.mark.backends("sqlite")
def test_a_log_that_stored_nothing_leaves_its_step_to_the_next(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"i": 0})
        conn = w._open.segment.appender._cursor.connection  # a tiny disk: SQLite may not grow the file past this
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count={pages}")
        with pytest.raises(walbuf.BufferFullError):
            w.log({"i": 1, "payload": "x" * 100_000})
        conn.execute("PRAGMA max_page_count=1073741823")  # space freed
        assert w.log({"i": 1}) == 1
    assert steps(buffer) == [0, 1]
