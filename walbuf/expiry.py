"""The expiry thread: runs what must happen at a time even if nobody logs.

Each process has one daemon thread that runs the actions scheduled with
:func:`call_at` when their time comes: a directory buffer's shard notes
that its process still runs while its writers are idle (see
walbuf.directory.appender), and a PostgreSQL writer renews the lease on its
id (see walbuf.writer).

Fork safety. The thread does I/O (SQLite, file locks) at moments the
program does not choose, and a child forked while it is inside SQLite
would inherit SQLite's internal state half-changed. So an action runs
while it holds ``_busy``, and os.fork() takes ``_busy`` before it forks
(os.register_at_fork): a fork waits for the action under way to end. Then
the locks the child inherits are released, and the child has no expiry
thread and no scheduled actions (they were the parent's) until its own
writers schedule some.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

_log = logging.getLogger(__name__)

_busy = threading.Lock()  # held while an action runs, and by os.fork() around a fork
_changed = threading.Condition(threading.Lock())
_queue: list[tuple[float, int, Callable[[], None]]] = []  # (wall-clock time, order, action), a heap
_order = itertools.count()
_thread: threading.Thread | None = None


def call_at(when: float, action: Callable[[], None]) -> None:
    """Run ``action`` in this process's expiry thread once the wall-clock time ``when`` has passed.

    The action must be quick, catch the errors it expects (it runs where no
    caller can handle them: an exception is a bug, reported by the thread's
    excepthook, and the thread is started again by the next call_at), and
    check when it runs that what it acts on is still there (a shard still
    held, a writer still open).
    """
    global _thread
    with _changed:
        heapq.heappush(_queue, (when, next(_order), action))
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="walbuf-expiry", daemon=True)
            _thread.start()
        _changed.notify()


def call_after(seconds: float, action: Callable[[], None]) -> None:
    """:func:`call_at` ``seconds`` from now."""
    call_at(time.time() + seconds, action)


def _run() -> None:
    while True:
        with _changed:
            while not _queue or _queue[0][0] > time.time():
                _changed.wait(None if not _queue else _queue[0][0] - time.time())
            _, _, action = heapq.heappop(_queue)
        with _busy:
            action()


def _before_fork() -> None:
    if not _busy.acquire(blocking=False):
        _log.debug("fork waits for walbuf's expiry thread to finish what it is doing")
        _busy.acquire()
    _changed.acquire()


def _after_fork_in_parent() -> None:
    _changed.release()
    _busy.release()


def _after_fork_in_child() -> None:
    # The child's own: the parent's thread, its actions and its waiters are not here.
    global _thread, _busy, _changed
    _queue.clear()
    _thread = None
    _busy, _changed = threading.Lock(), threading.Condition(threading.Lock())


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
