"""walbuf.Histogram: bins and counts made at log(), stored small, sent as a wandb.Histogram.

Syncs run in this process against the session's fake server (``in_process``).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import walbuf_command
from hypothesis import given
from hypothesis import strategies as st

import walbuf
from walbuf import Histogram, MetricTypeError, MetricValueError

pytestmark = pytest.mark.backends("sqlite")


def test_bins_and_counts_are_numpys():
    values = np.random.default_rng(0).normal(size=1000)
    counts, edges = np.histogram(values, bins=16)
    h = Histogram(values, num_bins=16)
    assert h.counts == tuple(counts.tolist()) and h.bins == tuple(edges.tolist())


def test_nan_and_infinities_are_counted_out():
    h = Histogram([1.0, 2.0, math.nan, math.inf, -math.inf, 3.0], num_bins=2)
    assert sum(h.counts) == 3 and h.bins == (1.0, 2.0, 3.0)


def test_a_histogram_with_nothing_finite_is_refused():
    with pytest.raises(MetricValueError, match="finite"):
        Histogram([math.nan, math.inf])


@pytest.mark.parametrize("num_bins", [0, 513, True, 2.0])
def test_a_number_of_bins_w_and_b_refuses_is_refused(num_bins):
    with pytest.raises(MetricValueError, match="num_bins"):
        Histogram([1, 2, 3], num_bins=num_bins)


def test_a_value_that_is_not_numbers_is_refused():
    with pytest.raises(MetricTypeError, match="Histogram takes"):
        Histogram(["a", "b"])


def test_torch_tensors_of_any_shape_and_dtype_are_taken():
    weights = torch.randn(30, 10, dtype=torch.bfloat16, requires_grad=True)
    assert sum(Histogram(weights).counts) == 300


def test_values_numpy_cannot_bin_are_refused_with_what_to_do():
    with pytest.raises(MetricValueError, match="fewer bins"):
        Histogram([2.0**50], num_bins=6)  # a bin 1/6 wide is below float precision there


@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=1), st.integers(1, 512))
def test_every_finite_value_is_counted_once_in_increasing_bins(values, num_bins):
    h = Histogram(values, num_bins=num_bins)
    assert sum(h.counts) == len(values)
    assert len(h.bins) == num_bins + 1 and all(a < b for a, b in zip(h.bins, h.bins[1:], strict=False))


def test_a_logged_histogram_is_read_back_equal(buffer):
    h = Histogram(range(100), num_bins=10)
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"weights": h, "loss": 0.5})
    (record,) = walbuf.read(buffer)
    assert record.metrics == {"weights": h, "loss": 0.5}


def test_walbuf_records_prints_a_histogram_in_w_and_bs_form(buffer):
    h = Histogram([1, 2, 2, 3], num_bins=2)
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"h": h})
    proc = walbuf_command("records", str(buffer))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["metrics"] == {
        "h": {"_type": "histogram", "values": [1, 3], "bins": [1.0, 2.0, 3.0]}
    }


def test_a_value_marked_histogram_that_is_not_one_is_refused_and_nothing_written(buffer):
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        with pytest.raises(MetricValueError, match="marked a histogram"):
            w.log({"h": {"_type": "histogram", "values": [1, 2], "bins": [0.0, 1.0]}})
    assert list(walbuf.read(buffer)) == []


def test_a_synced_histogram_arrives_with_its_bins_and_counts(in_process, buffer):
    h = Histogram(np.arange(1000) % 7, num_bins=7)
    with walbuf.Writer(buffer, writer="w", run="r") as w:
        w.log({"grad/layer1": h})
    result = walbuf.sync(buffer)
    assert result.records == 1
    (fake_run,) = [in_process.run(result.runs[0].target.wandb_id)]
    (row,) = [row for row in fake_run.history if "w/grad/layer1" in row]
    assert row["w/grad/layer1"] == {"_type": "histogram", "values": list(h.counts), "bins": list(h.bins)}
