"""Writers across processes: pickling, fork, pools, many processes at once, kill -9."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import workers
from conftest import by_writer

import walbuf

pytestmark = [pytest.mark.backends("sqlite", "postgresql"), pytest.mark.slow]

START_METHODS = ["spawn", "fork", "forkserver"]
TESTS = Path(__file__).parent


def test_pickled_writer_carries_settings_not_connection(buffer):
    w = walbuf.Writer(buffer, writer="w", run="r", step_axis="s")
    data = pickle.dumps(w)
    assert b"sqlite3" not in data and len(data) < 1000
    w.close()
    clone = pickle.loads(data)
    assert (clone.run, clone.writer, clone.step_axis) == ("r", "w", "s")
    clone.log({"a": 1})
    clone.close()
    assert [r.writer for r in walbuf.read(buffer)] == ["w"]


@pytest.mark.parametrize("method", START_METHODS)
def test_writer_without_explicit_id_becomes_each_childs_own_writer(buffer, method):
    ctx = mp.get_context(method)
    parent = walbuf.Writer(buffer, run="mp")
    parent.log({"parent": 1})
    procs = [ctx.Process(target=workers.log_n, args=(parent, 25)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    parent.log({"parent": 2})  # the parent's connection is untouched by its children
    parent.close()
    groups = by_writer(buffer, run="mp")
    host = socket.gethostname()
    children = {f"{host}-{p.pid}" for p in procs}
    assert set(groups) == children | {f"{host}-{os.getpid()}"}
    for name in children:
        assert [r.step for r in groups[name]] == list(range(25))
        assert [r.metrics["i"] for r in groups[name]] == list(range(25))


@pytest.mark.parametrize("method", START_METHODS)
def test_child_using_the_parents_explicit_id_while_parent_is_open_is_refused(buffer, method):
    ctx = mp.get_context(method)
    parent = walbuf.Writer(buffer, writer="trainer")
    child = ctx.Process(target=workers.log_n_exit_code, args=(parent, 5))
    child.start()
    child.join()
    assert child.exitcode == 3  # WriterConflictError in the child
    parent.log({"still": "mine"})
    parent.close()
    assert [r.metrics for r in walbuf.read(buffer)] == [{"still": "mine"}]


def test_forked_child_keeps_off_the_parents_writer_lock(buffer):
    parent = walbuf.Writer(buffer, writer="trainer")
    child = mp.get_context("fork").Process(target=workers.log_n_exit_code, args=(parent, 1))
    child.start()
    child.join()
    # The child exited (and dropped what it inherited); the id is still the parent's.
    with pytest.raises(walbuf.WriterConflictError):
        walbuf.Writer(buffer, writer="trainer")
    parent.close()


def test_explicit_id_can_be_handed_to_a_child_once_the_parent_closed_it(buffer):
    parent = walbuf.Writer(buffer, writer="handover")
    parent.log({"who": "parent"})
    parent.close()
    child = mp.get_context("spawn").Process(target=workers.log_n, args=(parent, 2))
    child.start()
    child.join()
    assert child.exitcode == 0
    assert [r.step for r in walbuf.read(buffer)] == [0, 1, 2]


def test_writer_sent_to_a_process_pool(buffer):
    w = walbuf.Writer(buffer, run="pool")
    with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
        names = list(pool.map(workers.log_n, [w] * 4, [10] * 4))
    w.close()
    groups = by_writer(buffer, run="pool")
    assert sum(len(groups[n]) for n in set(names)) == 40
    assert all(len(groups[n]) % 10 == 0 for n in set(names))


@pytest.mark.parametrize("method", START_METHODS)
def test_decorated_function_in_a_process_pool_logs_every_call_once(buffer, method):
    # The pool's initializer configures walbuf in each worker (a forkserver
    # child inherits the server's environment, not this test's).
    with ProcessPoolExecutor(
        max_workers=3,
        mp_context=mp.get_context(method),
        initializer=workers.set_env,
        initargs=("WALBUF_BUFFER", str(buffer)),
    ) as pool:
        results = list(pool.map(workers.evaluate, range(0, 200, 10)))
    assert [r["train_step"] for r in results] == list(range(0, 200, 10))
    records = list(walbuf.read(buffer, run="pool", writer="eval"))
    assert [r.step for r in records] == list(range(20))
    assert sorted(r.metrics["train_step"] for r in records) == list(range(0, 200, 10))


def test_sixteen_processes_starting_on_a_new_buffer_lose_nothing(buffer):
    ctx = mp.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=workers.concurrent_writer, args=(str(buffer), i, 400, go)) for i in range(16)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * 16  # a "database is locked" would exit 1
    groups = by_writer(buffer, run="many")
    assert sorted(groups) == [f"w{i:02d}" for i in range(16)]
    for records in groups.values():
        assert [r.step for r in records] == list(range(400))
        assert [r.metrics["i"] for r in records] == list(range(400))


def _start_victim(buffer: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "writer_loop.py"), str(buffer)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.parametrize("after", [1, 50, 1500])
def test_kill_9_of_a_writer_loses_nothing_log_returned_for(buffer, after):
    proc = _start_victim(buffer)
    assert proc.stdout is not None
    acknowledged = [int(proc.stdout.readline()) for _ in range(after)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    stored = [r.step for r in walbuf.read(buffer, run="crash")]
    # Every acknowledged step is there; a record logged but not yet printed may be too.
    assert stored[: len(acknowledged)] == acknowledged == list(range(after))
    assert stored == list(range(len(stored)))


def test_writer_id_of_a_killed_process_is_free_and_continues_its_steps(buffer):
    proc = _start_victim(buffer)
    assert proc.stdout is not None
    for _ in range(10):
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    last = [r.step for r in walbuf.read(buffer)][-1]
    with walbuf.Writer(buffer, writer="victim", run="crash") as w:
        assert w.log({"value": 2.0}) == last + 1


@pytest.mark.parametrize("attempt", range(5))
def test_pool_workers_creating_a_new_buffer_at_once_never_see_locked(buffer, attempt):
    ctx = mp.get_context("fork")
    with ProcessPoolExecutor(
        max_workers=4, mp_context=ctx, initializer=workers.set_env, initargs=("WALBUF_BUFFER", str(buffer))
    ) as pool:
        list(pool.map(workers.evaluate, range(8)))
    assert len(list(walbuf.read(buffer))) == 8
