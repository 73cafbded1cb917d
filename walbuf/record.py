"""The record: what one log() call stores, and the validation of its metrics.

A record is (run, writer, step, time, metrics). Metric values are int, float,
bool, str or None; numpy and torch scalars and 0-d arrays are converted to
those (without importing numpy or torch: they are recognised by type name);
a :class:`~walbuf.histogram.Histogram` is stored as its bins and counts (in
W&B's JSON form for it), a :class:`~walbuf.image.Image` as its PNG (base64);
nested mappings are flattened with "/". Anything else is refused with a
:class:`~walbuf.errors.MetricTypeError` naming the key, before anything is
written.

Metrics are stored as JSON text. Python's json module writes NaN and +-inf as
the literals NaN/Infinity/-Infinity and reads them back, and floats round-trip
exactly through repr, so every accepted value comes back as it went in.
"""

from __future__ import annotations

import json
import json.encoder
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from .errors import NOTHING_STORED, NOTHING_WRITTEN, MetricTypeError, MetricValueError
from .histogram import Histogram
from .histogram import stored as stored_histogram
from .image import TYPE as IMAGE
from .image import Image
from .image import stored as stored_image

Scalar = int | float | bool | str | None
Value = int | float | bool | str | None | list[Any] | Histogram | Image
"""A metric value as read back (a list holds scalars and lists)."""
Stored = int | float | bool | str | None | list[Any] | dict[str, Any]
"""A metric value as stored (a histogram or an image in its JSON form)."""

_PRIMITIVE = frozenset({int, float, bool, str, type(None)})


@dataclass(frozen=True)
class Record:
    """One logged record, as read back from a buffer.

    ``step`` is the writer's own step (its step axis), ``time`` the wall-clock
    time (seconds since the epoch) at which log() was called, ``metrics`` the
    flattened metrics. ``quarantined`` is why a sync quarantined the record
    (W&B refuses it for good, so it is never sent); None for the others.
    """

    run: str
    writer: str
    step: int
    time: float
    metrics: dict[str, Value]
    quarantined: str | None = None


def _scalar(value: Any) -> Any:
    """Convert a numpy/torch scalar or 0-d array to a Python value; else return ``value``."""
    module = type(value).__module__ or ""
    if module == "numpy" or module.startswith(("numpy.", "torch")):
        ndim = getattr(value, "ndim", None)
        if ndim == 0 and hasattr(value, "item"):
            return value.item()
    return value


def _convert(key: str, value: Any, what: str = "metric") -> Scalar:
    kind = type(value)
    if kind is str:
        _check_text(key, value, what)
        return cast(str, value)
    if kind is int:
        return _checked_int(key, value, what)
    if kind in _PRIMITIVE:
        return cast(Scalar, value)
    # Subclasses (numpy.float64 is a float, IntEnum an int) are stored as the base kind.
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return _checked_int(key, int(value), what)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        _check_text(key, value, what)
        return str(value)
    converted = _scalar(value)
    if converted is not value and type(converted) in _PRIMITIVE:
        return _checked_int(key, converted, what) if type(converted) is int else converted
    raise MetricTypeError(
        f"metric {key!r} has a value of type {kind.__module__}.{kind.__qualname__}, "
        "which walbuf does not store; log an int, float, bool, str, None, a numpy or torch scalar,"
        " a list of those (an array's .tolist()), a walbuf.Histogram (of a list, array or tensor),"
        " a walbuf.Image, or a dict of those",
        NOTHING_WRITTEN,
    )


def _checked_int(key: str, value: int, what: str) -> int:
    if not -FLOAT_MAX <= value <= FLOAT_MAX:
        raise MetricValueError(
            f"{what} {key!r} is an int beyond a 64-bit float's range: W&B keeps numbers as 64-bit floats, so it"
            " would arrive as infinity; log it as a str",
            NOTHING_WRITTEN,
        )
    return value


# W&B's limits and reserved names, each with its source. A record that breaks
# one is refused at log(), before anything is written: W&B would refuse or
# drop it at sync, for good.
MAX_VALUE_BYTES = 1_000_000
"""A single value under 1 MB: W&B docs, "Experiments limits and performance"."""
MAX_LINE_BYTES = (10 << 20) - (100 << 10)
"""wandb-core skips a longer history line with only a warning (core/internal/filestream/
filestream.go, defaultMaxFileLineBytes; updatehistory.go)."""
LINE_OVERHEAD = 1024
"""Room in a history line for what the syncer adds: the step axis, _timestamp, _runtime, _step."""
MAX_IMAGES_BYTES = 32 << 20
"""The images of one record, as stored: walbuf's own limit (each is at most image.MAX_PNG_BYTES)."""
MAX_DEPTH = 32
"""Nesting of a metrics dict: deeper than any real use, far short of Python's recursion limit."""
FLOAT_MAX = sys.float_info.max
"""An int beyond it reaches W&B as infinity: wandb-core parses history numbers as float64 (Go's encoding/json)."""
RESERVED_KEYS = frozenset({"_step", "_runtime", "_timestamp", "_wandb"})
"""wandb-core numbers every row's _step (core/internal/stream/historystep.go), the syncer gives each row its
_timestamp and _runtime (wandb's run.log would overwrite them: stream/handler.go, flushPartialHistory), and
_wandb holds wandb's own config and summary."""

CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f]")
# Keys that passed _check_key in this process (metrics repeat their keys every step).
_checked_keys: set[str] = set()
_CHECKED_KEYS_MAX = 100_000
PLAIN_TYPES = frozenset({int, float, bool, type(None)})
"""The types of value flatten() stores as they are, with no check, once their key is known."""


def flatten(metrics: Any, reserved: str | None = None) -> dict[str, Stored]:
    """Validate ``metrics`` and return them flattened, nested keys joined with "/".

    ``reserved`` is a key the caller may not use (the writer's step axis).
    Raises MetricTypeError or MetricValueError, naming the key: a key that
    is not text W&B can store (not valid UTF-8, a NUL or other control
    character, blank, '*'), one of W&B's reserved names, nesting deeper
    than MAX_DEPTH, a value over MAX_VALUE_BYTES.
    """
    if not isinstance(metrics, Mapping):
        raise MetricTypeError(
            f"metrics must be a dict of name -> value, not {type(metrics).__qualname__}", NOTHING_WRITTEN
        )
    flat: dict[str, Stored] = {}
    _flatten_into(flat, "", metrics, 1)
    if reserved is not None and reserved in flat:
        raise MetricValueError(
            f"metric {reserved!r} is this writer's step axis; pass the step as log(..., step=N) instead",
            NOTHING_WRITTEN,
        )
    return flat


def line_room(count: int, prefix: str) -> int:
    """The longest stored payload of ``count`` values, each key behind ``prefix``, that surely fits a history line.

    Every value is counted as stored (an image as its PNG, not the reference
    the line holds): a payload within this needs no closer look (see check_line).
    """
    return MAX_LINE_BYTES - LINE_OVERHEAD - count * len(prefix)


def check_line(payload: str, values: Mapping[str, Stored], prefix: str) -> None:
    """Raise MetricValueError if a record (``values``, stored as ``payload``) would make a history line over W&B's
    limit.

    ``prefix`` is what the syncer puts before each key. An image counts as
    the reference to its file that the history line holds; the images of
    one record may take at most MAX_IMAGES_BYTES.
    """
    room = line_room(len(values), prefix)
    if len(payload) <= room:
        return  # the common case: no need to look at the values
    size = len(payload) - room + MAX_LINE_BYTES  # the line's size, every value counted as stored
    images = [value["png"] for value in values.values() if type(value) is dict and value["_type"] == IMAGE]
    stored_images = sum(len(png) for png in images)
    if stored_images > MAX_IMAGES_BYTES:
        raise MetricValueError(
            f"the record's images take {stored_images:,} bytes, over walbuf's limit of {MAX_IMAGES_BYTES:,}"
            " for one record; log them in several calls",
            NOTHING_WRITTEN,
        )
    size -= stored_images - len(images) * IMAGE_REFERENCE
    if size > MAX_LINE_BYTES:
        raise MetricValueError(
            f"the record is {size:,} bytes as a W&B history line, over W&B's limit of"
            f" {MAX_LINE_BYTES:,} (wandb would drop it); log fewer or smaller values per"
            " call",
            NOTHING_WRITTEN,
        )


IMAGE_REFERENCE = 512
"""Bytes of a history line for one image: wandb's reference to its file (path, sha256, size, ...)."""


def _flatten_into(flat: dict[str, Stored], prefix: str, metrics: Mapping[Any, Any], depth: int) -> None:
    for key, value in metrics.items():
        if (
            type(key) is str
            and key in _checked_keys
            and type(value) in PLAIN_TYPES
            and (type(value) is not int or -FLOAT_MAX <= value <= FLOAT_MAX)
            and (prefix or key not in RESERVED_KEYS)
            and prefix + key not in flat
        ):
            flat[prefix + key] = value  # the common case, checked cheaply
            continue
        if type(key) is not str:
            if not isinstance(key, str):
                raise MetricTypeError(
                    f"metric key {prefix + repr(key)} is of type {type(key).__qualname__}; keys must be str",
                    NOTHING_WRITTEN,
                )
            key = str(key)
        _check_key(prefix, key, "metric")
        name = prefix + key
        if name in RESERVED_KEYS:
            raise MetricValueError(
                f"metric {name!r} is a name W&B reserves for itself (it would overwrite or drop it); rename it",
                NOTHING_WRITTEN,
            )
        if isinstance(value, (Histogram, Image)):
            value = value.to_json()
        leaf = (stored_histogram(name, value) or stored_image(name, value)) if isinstance(value, Mapping) else None
        if isinstance(value, Mapping) and leaf is None:
            if depth >= MAX_DEPTH:
                raise MetricValueError(
                    f"metric {name!r} holds dicts nested more than {MAX_DEPTH} deep; flatten them", NOTHING_WRITTEN
                )
            _flatten_into(flat, name + "/", value, depth + 1)
            continue
        if name in flat:
            raise MetricValueError(
                f"metric {name!r} is given twice (once nested, once with '/' in its key)", NOTHING_WRITTEN
            )
        if isinstance(value, (list, tuple)):
            flat[name] = _sequence(name, value, depth)
        else:
            flat[name] = leaf if leaf is not None else _convert(name, value)


def _sequence(name: str, values: list[Any] | tuple[Any, ...], depth: int, *, whole: bool = True) -> list[Any]:
    """A list or tuple of metric values (and of lists of them) as the list W&B's history keeps.

    ``whole``: the metric's value itself, not a list inside it; W&B's limit
    for one value applies to it as JSON.
    """
    if depth >= MAX_DEPTH:
        raise MetricValueError(f"metric {name!r} holds lists nested more than {MAX_DEPTH} deep", NOTHING_WRITTEN)
    out = [
        _sequence(f"{name}[{i}]", item, depth + 1, whole=False)
        if isinstance(item, (list, tuple))
        else _convert(f"{name}[{i}]", item)
        for i, item in enumerate(values)
    ]
    if whole:
        size = len(encode_metrics({name: out}))
        if size > MAX_VALUE_BYTES:
            raise MetricValueError(
                f"metric {name!r} is a list of {size:,} bytes as JSON, over W&B's limit of {MAX_VALUE_BYTES:,}"
                " for one value",
                NOTHING_WRITTEN,
            )
    return out


def _check_key(prefix: str, key: str, what: str, *, star: bool = False) -> None:
    """Raise MetricValueError unless ``key`` (a part of a name) is one W&B stores as given.

    ``star``: '*' is a plain character (in config keys; in metric names it is define_metric's wildcard).
    """
    if key in _checked_keys:
        return
    name = prefix + key
    problem = ""
    if not key:
        problem = "is empty"
    elif not key.strip():
        problem = "is blank"
    elif "*" in key and not star:
        problem = "contains '*', which W&B's define_metric reads as a wildcard"
    elif CONTROL_CHARACTERS.search(key):
        problem = "contains a control character (a NUL, a newline, ...)"
    elif not _is_utf8(key):
        problem = "is not valid text (it holds a lone surrogate, which UTF-8 cannot encode)"
    if problem:
        where = f" under {prefix[:-1]!r}" if prefix and not key else ""
        raise MetricValueError(f"{what} key {name!r}{where} {problem}; rename it", NOTHING_WRITTEN)
    if len(_checked_keys) < _CHECKED_KEYS_MAX and "*" not in key:
        _checked_keys.add(key)


def _is_utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_text(name: str, value: str, what: str) -> None:
    """A str value W&B stores: valid UTF-8 and under MAX_VALUE_BYTES."""
    if value.isascii() and len(value) <= MAX_VALUE_BYTES:
        return
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise MetricValueError(
            f"{what} {name!r} is a str that is not valid text (it holds a lone surrogate, which UTF-8 cannot encode)",
            NOTHING_WRITTEN,
        ) from None
    if size > MAX_VALUE_BYTES:
        raise MetricValueError(
            f"{what} {name!r} is {size:,} bytes, over W&B's limit of {MAX_VALUE_BYTES:,} for one value", NOTHING_WRITTEN
        )


def _encoder() -> Callable[[Any], str]:
    """json.dumps(value, separators=(",", ":"), allow_nan=True), made once.

    json.dumps() with arguments builds a new encoder on every call, and an
    encoder builds its C scanner on every encode(): here the C encoder is
    built once (json.encoder.c_make_encoder, as JSONEncoder.iterencode
    builds it), without the check for circular references, which nothing
    walbuf encodes can hold (flattened metrics, values decoded from JSON).
    """
    python = json.JSONEncoder(separators=(",", ":"), allow_nan=True)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # a Python without the C accelerator
        return python.encode
    chunks = make(None, python.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)

    def encode(value: Any) -> str:
        return "".join(chunks(value, 0))

    return encode


encode = _encoder()
"""Serialise flattened metrics for storage (JSON; NaN and +-inf kept)."""


def encode_metrics(flat: Mapping[str, Stored]) -> str:
    """:func:`encode` of what flatten() returned (which refused every int JSON or W&B could not take)."""
    return encode(flat)


class Shapes:
    """The key sets one writer logged, checked once: its next records of them, in plain numbers, skip the checks.

    A training loop logs the same keys at every step. Once a record was
    checked by flatten() and stored, :meth:`learn` keeps its keys;
    :meth:`encode` then gives, for a dict of those keys in that order whose
    values are all ints or finite floats, the very text
    ``encode_metrics(flatten(metrics, ...))`` gives, without checking the
    keys again. For anything else it answers None, and the caller takes the
    full path. At most MAX key sets are kept.
    """

    MAX = 64

    def __init__(self) -> None:
        # keys -> (their printf-style template, the longest payload needing no closer look: see line_room)
        self._known: dict[tuple[Any, ...], tuple[str, int]] = {}

    def encode(self, metrics: Any) -> str | None:
        """The payload of ``metrics`` if it is a dict of a learnt key set with plain numbers; else None."""
        if type(metrics) is not dict:
            return None
        known = self._known.get(tuple(metrics))
        if known is None:
            return None
        template, room = known
        values = tuple(metrics.values())
        for value in values:  # an int or a finite float (NaN fails both comparisons)
            kind = type(value)
            if (kind is not float and kind is not int) or not -FLOAT_MAX <= value <= FLOAT_MAX:
                return None
        # %r of an int or a finite float is its JSON text (json's encoder calls
        # the same int.__repr__ and float.__repr__).
        payload: str = template % values
        return payload if len(payload) <= room else None

    def learn(self, flat: Mapping[str, Stored], room: int) -> None:
        """Keep the keys of ``flat``, a record flatten() returned and the buffer stored (its keys claimed).

        ``room``: the longest payload of them that needs no closer look (see line_room).
        """
        keys = tuple(flat)
        # A key set already kept is not built again: a writer whose records of
        # it take the full path (a NaN, a text) would otherwise pay for its
        # template at every log().
        if keys in self._known or len(self._known) >= self.MAX:
            return
        # '%' in a key is doubled: the template is a printf-style format.
        self._known[keys] = ("{" + ",".join(encode(key).replace("%", "%%") + ":%r" for key in keys) + "}", room)


_decoder = json.JSONDecoder()
# The C scanner itself: JSONDecoder.decode() adds two passes of a regex for
# whitespace around the value, which encode() never writes.
_scan = _decoder.scan_once  # type: ignore[attr-defined]


def decode(text: str) -> Any:
    """Inverse of :func:`encode` (a histogram or an image comes back in its stored form, a dict).

    Raises json.JSONDecodeError if ``text`` is not JSON.
    """
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        end = -1
    if end != len(text):  # not as encode() writes it: the full parser, with its error if it is not JSON
        value = _decoder.decode(text)
    return value


def read_metrics(text: str) -> dict[str, Value]:
    """A stored record's metrics as the read API gives them (histograms and images as their classes).

    Raises ValueError if ``text`` is not what walbuf stores: not JSON, not
    a JSON object, nested too deep, or a nested value that is not a valid
    histogram or image.
    """
    if type(text) is not str:
        raise ValueError("its metrics are not text")
    try:
        values = decode(text)
    except RecursionError:
        raise ValueError("its metrics are JSON nested deeper than Python reads") from None
    if type(values) is not dict:
        raise ValueError("its metrics are not a JSON object")
    for key, value in values.items():
        if type(value) is dict:
            if stored_image(key, value) is not None:
                values[key] = Image.from_json(value)
            elif stored_histogram(key, value) is not None:
                values[key] = Histogram.from_counts(value["values"], value["bins"])
            else:
                raise ValueError(f"metric {key!r} is a nested value that is neither a histogram nor an image")
    return values


def encode_config(values: Any, what: str = "config") -> dict[str, str]:
    """Run config (or summary) as given to Writer.config(): each top-level key with its value as JSON text.

    Values are what W&B's config holds: int, float, bool, str, None, numpy or
    torch scalars, and lists and str-keyed dicts of those (kept nested).
    Anything else raises MetricTypeError naming the key; a key W&B cannot
    store as given (see flatten), a top-level key W&B reserves, nesting
    deeper than MAX_DEPTH or a value over MAX_VALUE_BYTES, MetricValueError.
    Nothing is stored on error.
    """
    if not isinstance(values, Mapping):
        raise MetricTypeError(f"{what} must be a mapping of str keys, not {type(values).__qualname__}")
    encoded = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise MetricTypeError(f"{what} key {key!r} is of type {type(key).__qualname__}; keys must be str")
        _check_key("", key, what, star=True)
        if key in RESERVED_KEYS:
            raise MetricValueError(f"{what} key {key!r} is a name W&B reserves for itself; rename it", NOTHING_STORED)
        text = json.dumps(_config_value(key, value, what, 1), allow_nan=True)
        if len(text) > MAX_VALUE_BYTES:
            raise MetricValueError(
                f"{what} key {key!r} holds {len(text):,} bytes, over W&B's limit of {MAX_VALUE_BYTES:,} for one value",
                NOTHING_STORED,
            )
        encoded[key] = text
    return encoded


def _config_value(key: str, value: Any, what: str, depth: int) -> Any:
    if isinstance(value, (Mapping, list, tuple)) and depth >= MAX_DEPTH:
        raise MetricValueError(f"{what} key {key!r} is nested more than {MAX_DEPTH} deep", NOTHING_STORED)
    if isinstance(value, Mapping):
        out = {}
        for sub, item in value.items():
            if not isinstance(sub, str):
                raise MetricValueError(f"{what} key {key!r} holds a non-str key {sub!r}", NOTHING_STORED)
            _check_key(f"{key}.", sub, what, star=True)
            out[sub] = _config_value(f"{key}.{sub}", item, what, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_config_value(f"{key}[{i}]", item, what, depth + 1) for i, item in enumerate(value)]
    try:
        return _convert(key, value, f"{what} key")
    except MetricTypeError:
        kind = type(value)
        raise MetricTypeError(
            f"{what} key {key!r} has a value of type {kind.__module__}.{kind.__qualname__};"
            " give an int, float, bool, str, None, or a list or dict of those",
            NOTHING_STORED,
        ) from None
