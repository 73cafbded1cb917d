"""Invariant: reading back yields, per writer, exactly the records logged, in order, with their steps."""

from __future__ import annotations

import pytest
from conftest import by_writer, fresh_buffer, same_metrics
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import walbuf
from walbuf.record import RESERVED_KEYS

pytestmark = pytest.mark.backends("sqlite", "postgresql")

WRITERS = ("rank-0", "rank-1", "eval")
AXIS = "axis"

# Text W&B takes: no surrogates (not UTF-8) in values; no control characters,
# blanks, wildcards or reserved names in keys (test_record.py checks that
# log() refuses those, whatever they are).
values = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
    st.none(),
)
keys = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=10).filter(
    lambda k: k.strip() and k != AXIS and "*" not in k and k not in RESERVED_KEYS
)
metrics = st.dictionaries(keys, values, min_size=1, max_size=5)  # log({}) is refused (test_writer)
# (which writer, metrics, None for an automatic step or an offset from the writer's last step)
calls = st.lists(
    st.tuples(st.sampled_from(WRITERS), metrics, st.one_of(st.none(), st.integers(-3, 5))),
    max_size=40,
)


@pytest.mark.slow
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(calls=calls)
def test_read_back_equals_what_was_logged_per_writer(backend, calls):
    expected: dict[str, list[tuple[int, dict]]] = {name: [] for name in WRITERS}
    with fresh_buffer(backend) as buffer:
        opened = {name: walbuf.Writer(buffer, writer=name, step_axis=AXIS) for name in WRITERS}
        for name, logged, offset in calls:
            history = expected[name]
            last = history[-1][0] if history else None
            if offset is None:
                step = opened[name].log(logged)
                assert step == (0 if last is None else last + 1)
            else:
                step = (last or 0) + offset
                try:
                    assert opened[name].log(logged, step=step) == step
                except ValueError:
                    assert step < 0 or (last is not None and step < last)
                    continue
                assert step >= 0 and (last is None or step >= last)
            history.append((step, logged))
        for w in opened.values():
            w.close()
        got = by_writer(buffer)
    for name in WRITERS:
        records = got.get(name, [])
        assert [r.step for r in records] == [step for step, _ in expected[name]]
        for record, (_, logged) in zip(records, expected[name], strict=False):
            assert same_metrics(record.metrics, logged)
