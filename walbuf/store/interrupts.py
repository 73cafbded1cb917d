"""Transactions an interruption cannot leave open: the main thread's are run whole, in a thread no signal reaches.

Python runs signal handlers in the main thread, between two bytecodes, so the
KeyboardInterrupt of a Ctrl-C (or whatever a handler of the program raises)
can land anywhere there: inside a write transaction after its BEGIN, or in
the clean-up that would roll it back. Two of them, the second in that
clean-up (a notebook user presses Ctrl-C twice), can leave the connection
inside its transaction, holding the buffer's write lock (SQLite) or the
lock every writer's transaction takes (PostgreSQL) until the connection is
closed; where a traceback keeps it referenced, as a notebook keeps the last
one, until the process ends. (tests/test_interrupts.py found one such pair
in SQLAlchemy's pool: the first as the transaction began, the second in the
pool's reset of the connection, before its rollback.) Blocking the signal
does not help where other threads run (a process-directed signal goes to any
thread that does not block it, and its handler still runs in the main
thread), and swapping the handlers would change the program's own.

So a transaction the main thread asks for with :func:`run_whole` runs in a
worker thread of its own, where no signal handler runs, and the main thread
waits for it. An interruption of that wait is raised at once, and the
transaction goes on to its commit or rollback; the next one waits for it, so
they still end in the order they were asked for. Other threads run theirs
themselves: no interruption reaches them.

The main thread's side touches only what an interruption cannot leave half
done (a C queue, a C lock): the worker is started with ``_thread`` (one C
call), not ``threading.Thread``, whose start an interruption can leave with
a lock taken that hangs the next thread. A hand-over costs about 40 µs
here, against the 6 ms of the write transactions a writer makes (a new key's
claim, config, its open and close); a log() of keys claimed before makes
none.
"""

from __future__ import annotations

import _thread
import os
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Generic, TypeVar

_T = TypeVar("_T")


class _Job(Generic[_T]):
    """``work()`` for the worker, and what it returned or raised."""

    def __init__(self, work: Callable[[], _T]) -> None:
        self._work = work
        self._done = _thread.allocate_lock()
        self._done.acquire()
        self._result: list[_T] = []
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result.append(self._work())
        except BaseException as exc:
            self._error = exc
        finally:
            self._done.release()

    def wait(self) -> _T:
        self._done.acquire()  # a signal interrupts this wait (and only this wait) in the main thread
        if self._error is not None:
            raise self._error
        return self._result[0]


_jobs: SimpleQueue[_Job[object]] = SimpleQueue()
# Taken for good by the one worker that serves _jobs: a second worker (started
# where an interruption came between a worker's start and the note of it in
# _worker_of) ends at once, so jobs run one at a time, in the order asked.
_serving = _thread.allocate_lock()
_worker_of = 0  # the process whose worker serves _jobs (0: none yet; a forked child starts its own)


def _serve(jobs: SimpleQueue[_Job[object]], serving: _thread.LockType) -> None:
    if not serving.acquire(False):
        return
    while True:
        jobs.get().run()


def run_whole(work: Callable[[], _T]) -> _T:
    """``work()``, which runs a transaction (or several) from BEGIN to COMMIT or ROLLBACK, never cut short by an
    interruption of the caller: from the main thread, the worker runs it (see the module docstring).

    Returns what work() returned and raises what it raised. An interruption
    of the main thread's wait (KeyboardInterrupt, or what a signal handler
    raises) is raised at once, while work() runs on to its end.
    """
    global _worker_of
    if threading.current_thread() is not threading.main_thread():
        return work()
    if _worker_of != os.getpid():
        try:
            _thread.start_new_thread(_serve, (_jobs, _serving))
        except RuntimeError:
            # No thread may start while the interpreter shuts down (Python
            # 3.12+): a writer closed at exit runs its transaction itself.
            return work()
        _worker_of = os.getpid()
    job = _Job(work)
    _jobs.put(job)  # type: ignore[arg-type]
    return job.wait()


def _after_fork_in_child() -> None:
    global _serving, _jobs, _worker_of
    # The parent's worker is not the child's, and holds the parent's lock.
    _serving, _jobs, _worker_of = _thread.allocate_lock(), SimpleQueue(), 0


os.register_at_fork(after_in_child=_after_fork_in_child)
