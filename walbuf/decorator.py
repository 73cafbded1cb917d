"""The decorator: a function whose returned dict is logged as one record."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .writer import Writer

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_WAIT = 60.0


def logged(
    buffer: str | os.PathLike[str] | None = None,
    *,
    writer: str | None = None,
    step_axis: str | None = None,
    run: str | None = None,
    durability: str = "normal",
    wait: float = DEFAULT_WAIT,
    project: str | None = None,
    entity: str | None = None,
    run_id: str | None = None,
) -> Callable[[F], F]:
    """Log the dict a function returns as one record; other return values pass through.

    The settings are those of :func:`walbuf.init`, resolved at each call in
    the process that makes it, so a decorated function sent to a process pool
    logs from the worker. Each call opens the writer, logs, and closes it:
    calls from several processes with the same writer id take turns (waiting
    up to ``wait`` seconds) and append to one stream, each call one step.

    Each call's record gets the writer's next step (last step plus one), in
    the order the calls finish. To plot against another quantity, return it
    as a metric (``{"train_step": 40, "eval/accuracy": 0.9}``). The dict is
    returned to the caller unchanged. If the function raises, or the dict is
    invalid, nothing is logged and the error propagates.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if isinstance(result, Mapping):
                with Writer(
                    buffer,
                    writer=writer,
                    step_axis=step_axis,
                    run=run,
                    durability=durability,
                    wait=wait,
                    project=project,
                    entity=entity,
                    run_id=run_id,
                ) as w:
                    w.log(result)
            return result

        return wrapper  # type: ignore[return-value]

    return decorate
