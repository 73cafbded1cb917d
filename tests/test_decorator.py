"""@walbuf.logged: a returned dict becomes one record; everything else passes through."""

from __future__ import annotations

import pickle

import pytest
import workers
from conftest import record_count, walbuf_says

import walbuf

pytestmark = pytest.mark.backends("sqlite", "postgresql")


def make(buffer, **settings):
    @walbuf.logged(buffer, writer="eval", step_axis="eval_step", run="exp1", **settings)
    def evaluate(checkpoint, *, scale=1.0):
        """Evaluate a checkpoint."""
        if checkpoint is None:
            return "no checkpoint"
        if checkpoint < 0:
            raise RuntimeError("bad checkpoint")
        return {"eval/accuracy": checkpoint * scale}

    return evaluate


def test_returned_dict_is_logged_as_one_record_and_returned_unchanged(buffer):
    evaluate = make(buffer)
    assert evaluate(0.5, scale=2.0) == {"eval/accuracy": 1.0}
    (record,) = walbuf.read(buffer)
    assert (record.run, record.writer, record.step, record.metrics) == ("exp1", "eval", 0, {"eval/accuracy": 1.0})


def test_each_call_is_the_next_step_of_the_writer(buffer):
    evaluate = make(buffer)
    for c in (0.1, 0.2, 0.3):
        evaluate(c)
    assert [r.step for r in walbuf.read(buffer)] == [0, 1, 2]


def test_calls_continue_after_records_of_an_earlier_process(buffer):
    with walbuf.Writer(buffer, writer="eval", step_axis="eval_step", run="exp1") as w:
        w.log({"eval/accuracy": 0.0}, step=7)
    make(buffer)(0.5)
    assert [r.step for r in walbuf.read(buffer)] == [7, 8]


def test_other_return_values_pass_through_and_log_nothing(buffer):
    assert make(buffer)(None) == "no checkpoint"
    assert record_count(buffer) == 0


def test_an_empty_dict_passes_through_and_logs_nothing(buffer):
    @walbuf.logged(buffer, writer="eval", run="exp1")
    def evaluate():
        return {}

    assert evaluate() == {}
    assert record_count(buffer) == 0


def test_exception_propagates_and_logs_nothing(buffer):
    with pytest.raises(RuntimeError, match="bad checkpoint"):
        make(buffer)(-1)
    assert record_count(buffer) == 0


def test_invalid_returned_dict_raises_and_logs_nothing(buffer):
    @walbuf.logged(buffer, writer="eval")
    def broken():
        return {"predictions": [1, object()]}

    with pytest.raises(TypeError, match=r"'predictions\[1\]'"):
        broken()
    assert record_count(buffer) == 0


def test_decorated_function_keeps_its_name_and_doc(buffer):
    evaluate = make(buffer)
    assert evaluate.__name__ == "evaluate" and evaluate.__doc__ == "Evaluate a checkpoint."


def test_module_level_decorated_function_pickles_by_reference():
    assert pickle.loads(pickle.dumps(workers.evaluate)) is workers.evaluate


def test_settings_are_read_from_the_environment_at_call_time(buffer, monkeypatch):
    monkeypatch.setenv("WALBUF_BUFFER", str(buffer))
    workers.evaluate(30)
    (record,) = walbuf.read(buffer)
    assert (record.run, record.writer, record.metrics["train_step"]) == ("pool", "eval", 30)


def test_call_while_the_writer_id_is_held_elsewhere_waits_then_fails(buffer):
    with walbuf.Writer(buffer, writer="eval", step_axis="eval_step", run="exp1"):
        with walbuf_says("'eval' of run 'exp1' is open elsewhere; waiting up to 0.2s") as waited:
            with pytest.raises(walbuf.WriterConflictError, match="was not closed within 0.2s"):
                make(buffer, wait=0.2)(0.5)
        assert waited.is_set()
