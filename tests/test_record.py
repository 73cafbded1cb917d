"""What a record may hold, how it comes back, and what is refused."""

from __future__ import annotations

import enum
import json
import math
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
from conftest import fresh_buffer, record_count, run_sql, same_metrics, same_value
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import walbuf
from walbuf.record import MAX_DEPTH, MAX_VALUE_BYTES, Shapes, encode, encode_metrics, flatten, line_room

ROUND_TRIP = {
    "int": 7,
    "negative int": -3,
    "big int": 2**62 + 1,
    "float": 0.1,
    "negative zero": -0.0,
    "tiny float": 5e-324,
    "huge float": 1.7976931348623157e308,
    "nan": float("nan"),
    "+inf": float("inf"),
    "-inf": float("-inf"),
    "true": True,
    "false": False,
    "str": "accuracy",
    "empty str": "",
    "unicode": "länge 🚀 \u0000",
    "none": None,
}


def log_and_read(buffer, metrics):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log(metrics)
    (record,) = list(walbuf.read(buffer))
    return record.metrics


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_value_comes_back_exactly(buffer, name):
    value = ROUND_TRIP[name]
    assert same_metrics(log_and_read(buffer, {name: value}), {name: value})


def test_a_record_stored_as_json_with_spaces_reads_back(buffer):
    # As another JSON writer (or a database's JSON type) would write it; walbuf writes no spaces.
    log_and_read(buffer, {"a": 1})
    run_sql(buffer, "UPDATE records SET metrics = :m", {"m": ' { "a" : 2.5 ,\n "b" : null } '})
    (record,) = list(walbuf.read(buffer))
    assert record.metrics == {"a": 2.5, "b": None}


def test_all_kinds_in_one_record_come_back_exactly(buffer):
    assert same_metrics(log_and_read(buffer, ROUND_TRIP), ROUND_TRIP)


@pytest.mark.parametrize(
    "value, expected",
    [
        (np.float32(1.5), 1.5),
        (np.float64(0.1), 0.1),
        (np.float16(0.5), 0.5),
        (np.int8(-4), -4),
        (np.int64(2**40), 2**40),
        (np.uint32(7), 7),
        (np.bool_(True), True),
        (np.array(2.5), 2.5),
        (np.array(3), 3),
        (np.array(True), True),
        (np.float64("nan"), float("nan")),
        (np.str_("hi"), "hi"),
    ],
    ids=repr,
)
def test_numpy_scalars_and_0d_arrays_become_python_values(buffer, value, expected):
    got = log_and_read(buffer, {"m": value})["m"]
    assert same_value(got, expected)


class _FakeTensor:
    """Stands in for a 0-d torch tensor: recognised by module name and ndim, like the real one."""

    __module__ = "torch"
    ndim = 0

    def __init__(self, value):
        self._value = value

    def item(self):
        return self._value


def test_torch_like_0d_tensor_is_converted_without_torch(buffer):
    assert log_and_read(buffer, {"loss": _FakeTensor(0.25)}) == {"loss": 0.25}


def test_real_torch_scalar_tensor_is_converted(buffer):
    torch = pytest.importorskip("torch")
    assert log_and_read(buffer, {"loss": torch.tensor(0.5)}) == {"loss": 0.5}


def test_subclasses_of_builtin_values_are_stored_as_the_builtin(buffer):
    class Level(enum.IntEnum):
        HIGH = 3

    got = log_and_read(buffer, {"level": Level.HIGH})
    assert got == {"level": 3} and type(got["level"]) is int


def test_nested_dicts_are_flattened_with_slash(buffer):
    got = log_and_read(buffer, {"eval": {"acc": 0.9, "loss": {"ce": 0.3}}, "lr": 1e-3})
    assert got == {"eval/acc": 0.9, "eval/loss/ce": 0.3, "lr": 1e-3}


def test_any_mapping_is_accepted(buffer):
    assert log_and_read(buffer, OrderedDict(a=1, b=OrderedDict(c=2))) == {"a": 1, "b/c": 2}


def test_logging_does_not_import_numpy_or_torch(buffer):
    code = (
        "import sys, walbuf\n"
        f"w = walbuf.init({str(buffer)!r}, writer='w')\n"
        "w.log({'a': 1.0, 'b': {'c': 'x'}})\n"
        "assert 'numpy' not in sys.modules, 'numpy imported'\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


BAD_VALUES = {
    "set": {1},
    "bytes": b"x",
    "complex": 1j,
    "object": object(),
    "function": len,
    "numpy 1-d array": np.array([1.0, 2.0]),
    "numpy datetime": np.datetime64("2026-01-01"),
    "non-0d fake tensor": type("T", (), {"__module__": "torch", "ndim": 1, "item": lambda self: 1})(),
}


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
def test_bad_value_raises_type_error_naming_the_key_and_writes_nothing(buffer, kind):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"ok": 1})
        with pytest.raises(TypeError, match="'outer/bad'"):
            w.log({"fine": 2, "outer": {"bad": BAD_VALUES[kind]}})
        assert w.last_step == 0
    assert record_count(buffer) == 1


def test_a_list_or_tuple_is_kept_as_a_list_as_w_and_bs_history_keeps_it(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"eval": {"per_class_f1": [0.5, 0.25]}, "shape": (2, [3, math.nan]), "empty": []})
    (record,) = walbuf.read(buffer)
    assert record.metrics["eval/per_class_f1"] == [0.5, 0.25] and record.metrics["empty"] == []
    assert record.metrics["shape"][:1] == [2] and math.isnan(record.metrics["shape"][1][1])


@pytest.mark.parametrize("item", [object(), {"a": 1}, b"x", np.array([1.0])], ids=["object", "dict", "bytes", "array"])
def test_a_list_holding_what_walbuf_does_not_store_names_the_item_and_writes_nothing(buffer, item):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(walbuf.MetricTypeError, match=r"'outer/bad\[1\]\[0\]'"):
            w.log({"outer": {"bad": [1, [item]]}})
    assert record_count(buffer) == 0


def test_a_list_over_w_and_bs_value_limit_is_refused_and_nothing_is_written(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(walbuf.MetricValueError, match="'big' is a list of .* over W&B's limit"):
            w.log({"big": [0.123456789] * 100_000})
    assert record_count(buffer) == 0


@pytest.mark.parametrize("key", [1, 2.5, None, ("a",), b"k"], ids=repr)
def test_non_str_key_raises_type_error_and_writes_nothing(buffer, key):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(walbuf.MetricTypeError, match="keys must be str"):
            w.log({"fine": 1, key: 2})
    assert record_count(buffer) == 0


def test_non_str_key_in_nested_dict_is_named_with_its_prefix(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(TypeError, match=r"eval/0"):
            w.log({"eval": {0: 1.0}})


@pytest.mark.parametrize("metrics", [[("a", 1)], "a=1", None, 3], ids=repr)
def test_metrics_that_are_not_a_mapping_are_refused(buffer, metrics):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(TypeError, match="must be a dict"):
            w.log(metrics)
    assert record_count(buffer) == 0


def test_empty_key_is_refused(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(ValueError, match="metric key '' is empty"):
            w.log({"": 1})
    assert record_count(buffer) == 0


def test_key_given_both_nested_and_flat_is_refused(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(ValueError, match="'a/b' is given twice"):
            w.log({"a/b": 1, "a": {"b": 2}})
    assert record_count(buffer) == 0


def test_metric_named_like_the_step_axis_is_refused(buffer):
    with walbuf.Writer(buffer, writer="w", step_axis="eval_step") as w:
        with pytest.raises(ValueError, match="step axis"):
            w.log({"eval_step": 3, "acc": 1.0})
    assert record_count(buffer) == 0


def test_key_with_a_wildcard_is_refused(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(ValueError, match="wildcard"):
            w.log({"grad*norm": 1.0})
    assert record_count(buffer) == 0


def nested(depth):
    metrics = {"leaf": 1}
    for _ in range(depth):
        metrics = {"d": metrics}
    return metrics


def self_containing():
    metrics = {"a": 1}
    metrics["again"] = metrics
    return metrics


WANDB_WOULD_REFUSE = {
    "lone surrogate in a key": ({"\ud800": 1}, "is not valid text"),
    "NUL in a key": ({"a\x00b": 1}, "control character"),
    "newline in a key": ({"loss\n": 1}, "control character"),
    "blank key": ({"   ": 1}, "is blank"),
    "_step": ({"_step": 1}, "reserves for itself"),
    "_timestamp": ({"_timestamp": 1.0}, "reserves for itself"),
    "_runtime": ({"_runtime": 1.0}, "reserves for itself"),
    "_wandb": ({"_wandb": {"m": 1}}, "reserves for itself"),
    "lone surrogate in a value": ({"text": "ok \udcff"}, "is not valid text"),
    "value over 1 MB": ({"big": "x" * (MAX_VALUE_BYTES + 1)}, "over W&B's limit of 1,000,000 for one value"),
    "nested 1,000 deep": (nested(1000), "nested more than"),
    "a dict that contains itself": (self_containing(), "nested more than"),
    "record over the history line limit": (
        {f"v{i}": "x" * MAX_VALUE_BYTES for i in range(11)},
        "as a W&B history line, over W&B's limit",
    ),
}


@pytest.mark.parametrize("case", sorted(WANDB_WOULD_REFUSE))
def test_what_wandb_would_refuse_or_drop_is_refused_at_log_naming_the_key(buffer, case):
    metrics, message = WANDB_WOULD_REFUSE[case]
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(walbuf.MetricValueError, match=message):
            w.log(metrics)
        assert w.log({"fine": 1}) == 0  # the writer goes on
    assert record_count(buffer) == 1


def test_a_reserved_name_nested_under_another_key_is_an_ordinary_metric(buffer):
    assert log_and_read(buffer, {"eval": {"_step": 3}}) == {"eval/_step": 3}


def test_values_up_to_the_limits_are_kept(buffer):
    metrics = {"big": "é" * (MAX_VALUE_BYTES // 2), "deep": nested(MAX_DEPTH - 2)}
    assert log_and_read(buffer, metrics)["big"] == metrics["big"]


def nested_lists(depth):
    value = [1.0]
    for _ in range(depth - 1):
        value = [value]
    return value


# Each limit at its edge: (what is kept, one past it, what the refusal says). A
# record is a dict: it is the first level of nesting, its values the second.
AT_THE_EDGE = {
    "dicts nested 32 deep": (nested(MAX_DEPTH - 1), nested(MAX_DEPTH), "nested more than"),
    "lists nested 32 deep": (
        {"l": nested_lists(MAX_DEPTH - 1)},
        {"l": nested_lists(MAX_DEPTH)},
        "nested more than",
    ),
    "a str of 1,000,000 bytes": ({"s": "x" * MAX_VALUE_BYTES}, {"s": "x" * (MAX_VALUE_BYTES + 1)}, "over W&B's limit"),
}


@pytest.mark.parametrize("case", sorted(AT_THE_EDGE))
def test_a_value_at_a_limit_is_kept_and_one_past_it_refused(buffer, case):
    kept, past, message = AT_THE_EDGE[case]
    with walbuf.Writer(buffer, writer="w") as w:
        w.log(kept)
        with pytest.raises(walbuf.MetricValueError, match=message):
            w.log(past)
    assert record_count(buffer) == 1


@pytest.mark.parametrize(
    "metrics, key",
    [({"x": 10**5000}, "x"), ({"n": {"x": -(10**309)}}, "n/x"), ({"l": [1, 2**1024]}, r"l\[1\]")],
    ids=["too long for text", "nested", "in a list"],
)
def test_an_int_beyond_a_float64s_range_is_refused_naming_the_key_and_nothing_is_written(buffer, metrics, key):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(walbuf.MetricValueError, match=f"metric '{key}' is an int beyond a 64-bit float's range"):
            w.log(metrics)
        assert w.log({"fine": 10**308}) == 0  # an int within a float's range is kept, and the writer goes on
    assert record_count(buffer) == 1


@pytest.mark.parametrize("kind", ["config", "summary"])
@pytest.mark.parametrize(
    "values, message",
    [
        ({"\ud800": 1}, "is not valid text"),
        ({"lr\n": 1}, "control character"),
        ({" ": 1}, "is blank"),
        ({"_wandb": 1}, "reserves for itself"),
        ({"model": {"a\x00": 1}}, "control character"),
        ({"notes": "x" * (MAX_VALUE_BYTES + 1)}, "over W&B's limit"),
        ({"deep": nested(1000)}, "nested more than"),
        ({"seeds": [1, 10**5000]}, r"'seeds\[1\]' is an int beyond a 64-bit float's range"),
    ],
    ids=["surrogate", "newline", "blank", "_wandb", "nested NUL", "too big", "too deep", "int beyond a float's range"],
)
def test_config_and_summary_refuse_what_wandb_would_refuse(buffer, kind, values, message):
    with walbuf.Writer(buffer, writer="w") as w:
        with pytest.raises(walbuf.MetricValueError, match=message):
            getattr(w, kind)(values)
    assert run_sql(buffer, "SELECT count(*) FROM config_entries") == [(0,)]


def test_a_star_is_a_plain_character_in_a_config_key(buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.config({"glob*": 1})
    assert run_sql(buffer, "SELECT key FROM config_entries") == [("glob*",)]


any_text = st.text(max_size=8)  # any code points: control characters, surrogates, blanks


@pytest.fixture(scope="module")
def open_writer():
    """One writer for every example (opening a buffer per example made this the quick loop's slowest test)."""
    with fresh_buffer("sqlite") as buffer, walbuf.Writer(buffer, writer="w") as w:
        yield buffer, w


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(metrics=st.dictionaries(any_text, st.one_of(any_text, st.integers(), st.floats(), st.none()), max_size=4))
def test_log_stores_a_record_exactly_or_refuses_it_and_writes_nothing(open_writer, metrics):
    buffer, w = open_writer
    before = len(list(walbuf.read(buffer)))
    try:
        w.log(metrics)
    except (walbuf.MetricTypeError, walbuf.MetricValueError):
        stored = None
    else:
        stored = metrics
    got = [r.metrics for r in walbuf.read(buffer)][before:]
    if stored is None:
        assert got == []  # refused: nothing written
    else:
        assert len(got) == 1 and same_metrics(got[0], stored)  # stored: exactly as given


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),  # NaN, the infinities, non-ASCII too
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(JSON_VALUES)
def test_what_walbuf_stores_is_the_json_that_json_dumps_writes(value):
    assert encode(value) == json.dumps(value, separators=(",", ":"), allow_nan=True)


# Values log() takes or refuses; huge ints (past a float64's range) included.
NUMBERS_AND_OTHERS = st.one_of(
    st.integers(), st.floats(), st.booleans(), st.none(), any_text, st.integers(min_value=10**307, max_value=10**309)
)
KEYS = any_text | st.sampled_from(["%", "a%s", "%(x)r", "%%"])  # '%' is printf's: the template must not read it


def _payload_or_refusal(metrics):
    try:
        return encode_metrics(flatten(metrics, "w/step"))
    except (walbuf.MetricTypeError, walbuf.MetricValueError):
        return None


@settings(max_examples=300)
@given(first=st.dictionaries(KEYS, NUMBERS_AND_OTHERS, min_size=1, max_size=4), data=st.data())
def test_a_learnt_key_set_encodes_a_record_as_the_full_check_does_or_leaves_it_to_it(first, data):
    shapes = Shapes()
    if _payload_or_refusal(first) is not None:  # log() learns the keys of the records it stores
        flat = flatten(first, "w/step")
        shapes.learn(flat, line_room(len(flat), "w/"))
    values = data.draw(st.lists(NUMBERS_AND_OTHERS, min_size=len(first), max_size=len(first)))
    second = dict(zip(first, values, strict=True))
    got, full = shapes.encode(second), _payload_or_refusal(second)
    if got is not None:
        assert got == full  # the very text of the full path, never a record it refuses
    plain = all(type(v) in (int, float) and -sys.float_info.max <= v <= sys.float_info.max for v in values)
    if _payload_or_refusal(first) is not None and tuple(flatten(first, "w/step")) == tuple(first) and plain:
        assert got is not None  # a record of plain numbers of a learnt key set takes the short path


def test_a_record_longer_than_what_needs_no_closer_look_is_left_to_the_full_check():
    shapes = Shapes()
    shapes.learn({"loss": 0.5}, room=len('{"loss":0.25}'))
    assert shapes.encode({"loss": 0.25}) == '{"loss":0.25}'
    assert shapes.encode({"loss": 0.125}) is None


def test_a_record_of_the_keys_logged_before_is_stored_exactly(open_writer):
    buffer, w = open_writer
    before = len(list(walbuf.read(buffer)))
    logged = [{"loss": 0.5, "acc%": 1}, {"loss": 0.25, "acc%": 2}, {"loss": float("nan"), "acc%": True}]
    for metrics in logged:
        w.log(metrics)
    got = [r.metrics for r in walbuf.read(buffer)][before:]
    assert len(got) == 3 and all(same_metrics(g, m) for g, m in zip(got, logged, strict=True))
