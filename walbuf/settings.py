"""A writer's settings: the argument, else the environment, else a default.

One frozen object, :class:`WriterSettings`, used by :class:`walbuf.Writer`,
``@walbuf.logged`` and the integrations, so that a launcher can configure
every process without code:

========================  ====================  ==========================================
setting                   environment           default
========================  ====================  ==========================================
buffer                    WALBUF_BUFFER         none: an error says to give one
writer                    WALBUF_WRITER         rank-$RANK, else <host>-rank-$LOCAL_RANK, else <host>-<pid>
prefix                    WALBUF_PREFIX         the writer id ("" for none: keys as logged)
run                       WALBUF_RUN            default
step_axis                 WALBUF_STEP_AXIS      step
========================  ====================  ==========================================

The prefix is what a writer's keys and step axis are called under in W&B:
``loss`` of writer ``train`` on axis ``step`` is ``train/loss`` against
``train/step``; with ``prefix=""`` it is ``loss`` against ``step``, as
logged. Writers with the same prefix and step axis make one curve per key.

The buffer and run are resolved when the settings are made; the writer id,
prefix and step axis in each process that logs, from that process's environment,
so settings sent to a worker (pickled, or inherited by fork) become that
worker's own: rank-N under a launcher that sets RANK, host-pid otherwise.
Directory buffers have two settings of the host, WALBUF_HOST and
WALBUF_ROTATE_SECONDS (see walbuf.directory.layout).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from .arguments import seconds
from .buffer import Buffer, Location, open_buffer
from .errors import ArgumentTypeError, ConfigError
from .record import CONTROL_CHARACTERS, RESERVED_KEYS
from .store import Durability, Target
from .store.backend import DURABILITY_LEVELS
from .store.target import check_target

if TYPE_CHECKING:
    from typing_extensions import Unpack

ENV_BUFFER = "WALBUF_BUFFER"
ENV_WRITER = "WALBUF_WRITER"
ENV_RUN = "WALBUF_RUN"
ENV_STEP_AXIS = "WALBUF_STEP_AXIS"
ENV_PREFIX = "WALBUF_PREFIX"
DEFAULT_RUN = "default"
DEFAULT_STEP_AXIS = "step"


def default_writer_id() -> str:
    """The writer id of this process when none is given: rank-based under a launcher, else host-pid."""
    rank = os.environ.get("RANK")
    if rank:
        return f"rank-{rank}"
    host = socket.gethostname()
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank:
        return f"{host}-rank-{local_rank}"
    return f"{host}-{os.getpid()}"


class WriterOptions(TypedDict, total=False):
    """The writer settings besides the buffer, as keyword arguments (see WriterSettings.resolve)."""

    writer: str | None
    prefix: str | None
    step_axis: str | None
    run: str | None
    durability: Durability
    wait: float
    project: str | None
    entity: str | None
    run_id: str | None


@dataclass(frozen=True)
class WriterSettings:
    """Everything a writer needs to know, resolved: see the module docstring.

    ``writer``, ``prefix`` and ``step_axis`` hold what was given (None: the
    process's default); :meth:`writer_id`, :meth:`key_prefix` and
    :meth:`axis` resolve them in the calling process. ``default_writer`` is
    the writer id to use instead of the process's default when neither
    ``writer`` nor $WALBUF_WRITER gives one (the decorator's: the function's
    name).
    """

    buffer: Buffer
    run: str
    writer: str | None
    step_axis: str | None
    durability: Durability
    wait: float
    target: Target
    prefix: str | None = None
    default_writer: str | None = None

    @classmethod
    def resolve(cls, buffer: Location | None = None, **options: Unpack[WriterOptions]) -> WriterSettings:
        """Check the arguments, fill in the environment's and the defaults; raise ConfigError on a bad one.

        ``buffer``: a path, URL or Buffer (default: $WALBUF_BUFFER), resolved
        for writing (see walbuf.open_buffer): a new path is fine, nothing is
        created yet. ``writer``: the stream's id (default: $WALBUF_WRITER,
        else rank-$RANK, else host-pid). ``step_axis``: the name its steps
        are logged under (default: $WALBUF_STEP_AXIS, else "step").
        ``run``: the run it belongs to (default: $WALBUF_RUN, else
        "default"). ``durability``: "normal" (a record survives the process
        dying) or "fsync" (survives power loss). ``wait``: seconds to wait
        for another process holding the same writer id to close it.
        ``project``, ``entity``, ``run_id``: the W&B run ``walbuf sync``
        uploads the run to, stored in the buffer.
        """
        writer, step_axis = options.get("writer"), options.get("step_axis")
        durability, wait = options.get("durability", "normal"), options.get("wait", 0.0)
        unknown = set(options) - set(WriterOptions.__annotations__)
        if unknown:
            raise ArgumentTypeError(f"unknown writer setting(s): {', '.join(sorted(unknown))}")
        if durability not in DURABILITY_LEVELS:
            raise ConfigError(f"durability must be one of {', '.join(DURABILITY_LEVELS)}, not {durability!r}")
        wait = seconds("wait", wait)
        for name, value in (("writer", writer), ("step_axis", step_axis)):
            if value is not None:
                _text(name, value, "")
        prefix = options.get("prefix")
        if prefix is not None:
            _check_prefix(prefix, "prefix")
        return cls(
            buffer=open_buffer(buffer if buffer is not None else os.environ.get(ENV_BUFFER, ""), create=True),
            run=_text("run", options.get("run"), ENV_RUN, DEFAULT_RUN),
            writer=writer,
            step_axis=step_axis,
            durability=durability,
            wait=float(wait),
            prefix=prefix,
            target=check_target(
                Target(
                    wandb_id=_optional("run_id", options.get("run_id")),
                    project=_optional("project", options.get("project")),
                    entity=_optional("entity", options.get("entity")),
                )
            ),
        )

    def writer_id(self) -> str:
        """This process's writer id: the one given, else $WALBUF_WRITER, else :func:`default_writer_id`."""
        writer = _text("writer", self.writer, ENV_WRITER, self.default_writer or default_writer_id())
        if "/" in writer or "*" in writer:
            raise ConfigError(
                f"writer id {writer!r} contains '/' or '*': in W&B a writer's keys are"
                " prefixed with '<writer>/' and '*' is a wildcard, so ids must not contain them"
            )
        return writer

    def key_prefix(self, writer_id: str) -> str:
        """This process's prefix: the one given, else $WALBUF_PREFIX (even ""), else ``writer_id``."""
        if self.prefix is not None:
            return self.prefix
        env = os.environ.get(ENV_PREFIX)
        if env is not None:
            return _check_prefix(env, ENV_PREFIX)
        return writer_id

    def axis(self) -> str:
        """This process's step axis: the one given, else $WALBUF_STEP_AXIS, else "step"."""
        step_axis = _text("step_axis", self.step_axis, ENV_STEP_AXIS, DEFAULT_STEP_AXIS)
        if "*" in step_axis:
            raise ConfigError(f"step_axis {step_axis!r} contains '*', which W&B reads as a wildcard")
        if step_axis in RESERVED_KEYS:
            raise ConfigError(f"step_axis {step_axis!r} is a name W&B reserves for itself; name the axis otherwise")
        return step_axis


def _check_prefix(value: Any, name: str) -> str:
    """A prefix W&B can take before "/<key>": "" (none), or text without '*' or a trailing '/'."""
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a str, not {type(value).__qualname__}")
    if "*" in value or value.endswith("/") or value.startswith("/") or (value and not value.strip()):
        raise ConfigError(
            f"{name} {value!r} is not a usable prefix: give \"\" for none, or a name without '*'"
            " (W&B's wildcard), leading or trailing '/' (walbuf puts one '/' between prefix and key)"
        )
    if CONTROL_CHARACTERS.search(value):
        raise ConfigError(f"{name} {value!r} contains a control character; W&B keys cannot hold one")
    return value


def _text(name: str, value: Any, env: str, default: str | None = None) -> str:
    """A name (a run, a writer id, a step axis): text W&B takes as it is, as part of a key or a run's name."""
    if value is None and env:
        value = os.environ.get(env) or default
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a str, not {type(value).__qualname__}")
    if not value:
        raise ConfigError(f"{name} must not be empty" + (f" (give it, or set {env})" if env else ""))
    problem = ""
    if not value.strip():
        problem = "is blank"
    elif CONTROL_CHARACTERS.search(value):
        problem = "contains a control character (a NUL, a newline, ...)"
    elif value != value.strip():
        problem = "begins or ends with a space (W&B's name would not show it)"
    elif not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            problem = "is not valid text (it holds a lone surrogate)"
    if problem:
        raise ConfigError(f"{name} {value!r} {problem}: W&B would get it changed, or refuse it; choose another")
    return value


def _optional(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{name} must be a non-empty str or None, not {value!r}")
    return value
