"""The batched hand-over writes each plain value of a row into wandb's history item exactly as wandb would."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st
from wandb.proto import wandb_internal_pb2 as pb
from wandb.sdk.interface.history_value import set_history_value

from walbuf.syncer.wandb.handover import _filler

PLAIN_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # wider than int64 too
    st.floats(),  # NaN and the infinities too
    st.text(),
    st.sampled_from(["\ud800", "a\udfffb"]),  # lone surrogates: JSON a buffer holds may spell them
)


def run_with(encoding: str) -> SimpleNamespace:
    return SimpleNamespace(_settings=SimpleNamespace(x_history_value_encoding=encoding))


def item_of(fill, value) -> bytes:
    item = pb.HistoryItem(key="k")
    fill(item, value)
    return item.SerializeToString(deterministic=True)


@given(PLAIN_VALUES)
def test_a_plain_value_fills_a_history_item_as_wandbs_own_function_does(value):
    def wandb_fill(item, v):
        set_history_value(item, v, json_form=True, typed_form=False)

    assert item_of(_filler(run_with("json")), value) == item_of(wandb_fill, value)


@given(PLAIN_VALUES)
def test_with_wandbs_typed_form_asked_for_a_value_fills_both_forms_as_wandb_does(value):
    def wandb_fill(item, v):
        set_history_value(item, v, json_form=True, typed_form=True)

    assert item_of(_filler(run_with("json,typed")), value) == item_of(wandb_fill, value)
