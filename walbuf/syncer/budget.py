"""What one sync may spend: records, and wall-clock time, wandb's start and finish included."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

INIT_TIMEOUT = 90.0  # seconds wandb may take to open a run, with no bound given


class OutOfTime(BaseException):
    """The time bound passed while wandb was still working (raised by the hard stop).

    A BaseException, as KeyboardInterrupt is: wandb catches Exception in places.
    """


class Budget:
    """The bounds of one sync invocation: ``max_records`` and ``max_seconds`` (None: unbounded).

    The time is for the whole invocation. Sending stops once what is left
    is the reserve kept for wandb's finish (a quarter of the bound, between
    1 and 60 seconds); wandb's start gets what is left less that reserve;
    and :meth:`hard_stop` raises OutOfTime in the main thread when the
    bound passes, whatever wandb is waiting for.
    """

    def __init__(self, max_records: int | None, max_seconds: float | None) -> None:
        self.remaining = max_records
        self.max_seconds = max_seconds
        self.deadline = None if max_seconds is None else time.monotonic() + max_seconds
        self.reserve = 0.0 if max_seconds is None else min(60.0, max(1.0, max_seconds / 4))

    def spent(self) -> bool:
        """Whether to stop sending: the records are used up, or only the reserve of time is left."""
        if self.remaining is not None and self.remaining <= 0:
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline - self.reserve

    def at_most(self, n: int) -> int:
        """``n``, or the records left if fewer."""
        return n if self.remaining is None else max(0, min(n, self.remaining))

    def take(self) -> None:
        """One record handled."""
        if self.remaining is not None:
            self.remaining -= 1

    def init_timeout(self) -> float:
        """How long wandb may take to open a run."""
        if self.deadline is None:
            return INIT_TIMEOUT
        return max(1.0, min(INIT_TIMEOUT, self.deadline - self.reserve - time.monotonic()))

    @contextmanager
    def hard_stop(self) -> Iterator[None]:
        """Raise OutOfTime in the block once the bound passes (main thread only; elsewhere no hard stop).

        An interval timer (SIGALRM) does it, since wandb may wait on a server
        that never answers; the timer and handler in place before are put
        back afterwards, and a timer another part of the program already
        runs is left alone (no hard stop then).
        """
        usable = (
            self.deadline is not None
            and threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL)[0] == 0
        )
        if not usable or self.deadline is None:
            yield
            return

        def out_of_time(signum: int, frame: FrameType | None) -> None:
            raise OutOfTime("the sync's time bound passed")

        previous = signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, max(0.001, self.deadline - time.monotonic()))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def process_age() -> float:
    """Seconds since this process started, its interpreter's start and imports included (0 where /proc is not)."""
    try:
        stat = Path("/proc/self/stat").read_text()
    except OSError:
        return 0.0
    # proc(5): field 22 is the start time in clock ticks after boot; the
    # fields after the command name (in parentheses) start at field 3.
    start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))


def end_process_after(seconds: float, last_words: Callable[[], int]) -> None:
    """End this process ``seconds`` from now, whatever it is doing then: ``last_words()`` runs, then os._exit with what
    it returns.

    For a command with a bound on its whole run (``walbuf sync
    --max-seconds``): the sync's own hard stop ends the upload at the
    bound, but what follows (wandb's teardown, which waits for wandb-core)
    has no bound of its own. A daemon thread's timer does this, so it also
    fires while the main thread waits in C. Nothing walbuf marks synced is
    at risk: a mark is one transaction, committed or not.
    """

    def expire() -> None:
        os._exit(last_words())

    timer = threading.Timer(max(0.0, seconds), expire)
    timer.daemon = True
    timer.start()
