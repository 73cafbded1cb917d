"""What confirms an online upload: wandb-core's account, in its internal log, of W&B answering each file_stream request.

The logs here have the lines wandb-core 0.31.0 writes (core
filestream/filestreamimpl.go: "filestream: sending request" with what the
request carries, "filestream: request sent" once W&B answered it with
success; stream/streamlogger.go: "stream: starting"), as recorded from a
sync against tests/wandb_server.py.
"""

from __future__ import annotations

import json

import pytest

from walbuf.syncer.wandb.confirmation import Account


def _line(msg, **fields):
    return json.dumps({"time": "2026-12-05T21:56:19.638307934Z", "level": "INFO", "msg": msg, **fields})


START = _line("stream: starting", **{"core version": "0.31.0"})


def _request(history_lines=None, **fields):
    extra = {} if history_lines is None else {"history_offset": 0, "history_lines": history_lines}
    return _line("filestream: sending request", total_files=2, **extra, **fields)


SENT = _line("filestream: request sent", status="200 OK")


def _unconfirmed(log, rows, finishing):
    """What finish() asks of the account of an ended upload."""
    account = Account(log)
    account.read()
    return account.missing(rows, finishing)


def unconfirmed(tmp_path, lines, rows, finishing=False):
    log = tmp_path / "debug-internal.log"
    log.write_text("".join(line + "\n" for line in lines))
    return _unconfirmed(log, rows, finishing)


def test_every_request_answered_with_all_rows_confirms_the_upload(tmp_path):
    assert unconfirmed(tmp_path, [START, _request(), SENT, _request(30), SENT, _request(20), SENT], rows=50) is None


def test_a_request_w_and_b_did_not_answer_confirms_nothing(tmp_path):
    found = unconfirmed(tmp_path, [START, _request(30), SENT, _request(20)], rows=50)
    assert found == "W&B answered 1 of wandb-core's 2 file_stream requests"


def test_an_answer_that_is_not_success_confirms_nothing(tmp_path):
    answered_500 = _line("filestream: request sent", status="500 Internal Server Error")
    assert unconfirmed(tmp_path, [START, _request(50), answered_500], rows=50) is not None


def test_fewer_rows_answered_than_handed_to_wandb_confirms_nothing(tmp_path):
    found = unconfirmed(tmp_path, [START, _request(49), SENT], rows=50)
    assert found == "W&B took 49 of the 50 history rows handed to wandb"


def test_a_finishing_upload_is_confirmed_only_with_its_finish_answered(tmp_path):
    lines = [START, _request(50), SENT, _request(), SENT]
    assert unconfirmed(tmp_path, lines, rows=50, finishing=True) == "W&B was not seen to take the run's finish"
    lines[-2] = _request(complete=True, exit_code=0)
    assert unconfirmed(tmp_path, lines, rows=50, finishing=True) is None


def test_only_the_last_stream_of_a_shared_log_counts(tmp_path):
    # Two uploads of one run in one second share a run folder, and wandb-core appends to its log.
    failed_earlier = [START, _request(50)]
    assert unconfirmed(tmp_path, [*failed_earlier, START, _request(20), SENT], rows=20) is None
    taken_earlier = [START, _request(50), SENT]
    assert unconfirmed(tmp_path, [*taken_earlier, START, _request(10), SENT], rows=20) is not None


@pytest.mark.parametrize(
    "text",
    ["", "not json at all\n", json.dumps({"message": "a form walbuf does not know"}) + "\n"],
    ids=["empty", "not json", "unknown form"],
)
def test_a_log_without_wandb_cores_account_confirms_nothing(tmp_path, text):
    log = tmp_path / "debug-internal.log"
    log.write_text(text)
    assert _unconfirmed(log, 0, False) is not None


def test_a_missing_log_confirms_nothing(tmp_path):
    assert _unconfirmed(tmp_path / "debug-internal.log", 0, False) is not None


def test_a_line_cut_off_at_the_end_confirms_nothing_it_would_have_said(tmp_path):
    log = tmp_path / "debug-internal.log"
    log.write_text(START + "\n" + _request(50) + "\n" + SENT[: len(SENT) // 2])
    assert _unconfirmed(log, 50, False) is not None


def test_a_log_read_as_it_grows_counts_each_line_once_and_a_line_under_way_when_whole(tmp_path):
    log = tmp_path / "debug-internal.log"
    account = Account(log)
    log.write_text(START + "\n" + _request(30) + "\n" + SENT + "\n" + _request(20) + "\n" + SENT[:10])
    account.read()
    assert account.taken() == 30
    with log.open("a") as f:
        f.write(SENT[10:] + "\n")
    account.read()
    assert account.taken() == 50 and account.missing(50, finishing=False) is None


@pytest.mark.parametrize("level", ["ERROR", "ERROR+4"])  # ERROR+4: slog's name for wandb-core's fatal level
def test_an_error_line_of_wandb_core_is_seen_as_it_is_written(tmp_path, level):
    log = tmp_path / "debug-internal.log"
    account = Account(log)
    giving_up = json.dumps({"level": level, "msg": "filestream: fatal error: giving up after 4 attempt(s)"})
    log.write_text(START + "\n" + _request(30) + "\n" + giving_up + "\n")
    account.read()
    assert account.errors and account.taken() == 0
