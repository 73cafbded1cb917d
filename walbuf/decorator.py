"""The decorator: a function whose returned dict is logged as one record."""

from __future__ import annotations

import atexit
import functools
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .buffer import Buffer, Location
from .settings import WriterSettings
from .store.source import Hold
from .writer import Writer

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .settings import WriterOptions

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_WAIT = 60.0


def logged(buffer: Location | None = None, **options: Unpack[WriterOptions]) -> Callable[[F], F]:
    """Log the dict a function returns as one record; other return values pass through.

    The settings are those of :class:`walbuf.Writer` (``wait`` defaults to
    60 seconds here), resolved at each call in the process that makes it, so
    a decorated function sent to a process pool logs from the worker. The
    writer id defaults to the function's name (``writer=`` or $WALBUF_WRITER
    override it), the same in every process: each call opens the writer,
    logs, and closes it, so calls from a pool's workers take turns (waiting
    up to ``wait`` seconds) and append to one stream, each call one step.

    Each call's record gets the writer's next step (last step plus one), in
    the order the calls finish. To plot against another quantity, return it
    as a metric (``{"train_step": 40, "eval/accuracy": 0.9}``). The dict is
    returned to the caller unchanged. If the function raises, or the dict is
    invalid, nothing is logged and the error propagates.

    On a directory buffer, a process that logs through the decorator keeps
    its live shard between calls (until it exits), so that many short calls
    append to one file rather than make one each.
    """
    options.setdefault("wait", DEFAULT_WAIT)

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if isinstance(result, Mapping) and result:  # an empty dict: nothing to log
                settings = replace(WriterSettings.resolve(buffer, **options), default_writer=fn.__name__)
                _keep_shard(settings.buffer)
                with Writer.from_settings(settings) as w:
                    w.log(result)
            return result

        return cast(F, wrapper)  # functools.wraps keeps fn's signature

    return decorate


# The shard this process keeps, per directory buffer: (pid, hold).
_kept: dict[str, tuple[int, Hold]] = {}  # by buffer location
_kept_lock = threading.Lock()


def _new_kept_lock() -> None:
    global _kept_lock
    _kept_lock = threading.Lock()  # a forked child's own: another thread of the parent may have held it


os.register_at_fork(after_in_child=_new_kept_lock)


def _keep_shard(buffer: Buffer) -> None:
    """On a directory buffer: keep this process's live shard between calls, until it exits (see logged)."""
    with _kept_lock:
        held = _kept.get(buffer.location)
        if held is not None:
            pid, hold = held
            if pid == os.getpid():
                return
            hold.abandon()  # the parent's: forked with it, not ours to release
            del _kept[buffer.location]
        new = buffer.hold_shard()
        if new is not None:  # None: a database buffer, no shard to hold
            _kept[buffer.location] = (os.getpid(), new)


@atexit.register
def _release_kept() -> None:
    with _kept_lock:
        for pid, hold in _kept.values():
            if pid == os.getpid():
                hold.release()
        _kept.clear()
