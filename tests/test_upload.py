"""Planning and upload, in-process, against a stand-in for the W&B run that records what it is handed.

These run in a fraction of a second each (no wandb, no server, no
subprocess), so the quick loop catches a broken plan or cursor. What the
real wandb and the fake server end with is tested in test_sync.py and
test_sync_faults.py; here the stand-in is what the upload talks to: it
keeps each upload's rows, and the rows of an upload whose finish succeeded
are what "W&B confirmed".
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import walbuf
from walbuf.buffer import open_buffer
from walbuf.errors import TargetRefusedError, UploadError
from walbuf.record import MAX_LINE_BYTES
from walbuf.store import Target
from walbuf.syncer.budget import Budget
from walbuf.syncer.syncer import PassChoices, sync_pass
from walbuf.syncer.wandb import RowRefused


@dataclass
class Upload:
    """What one upload handed the run: its rows in order, and how it ended."""

    target: Target
    name: str | None  # the display name, given only when the upload makes the W&B run
    config: dict[str, Any] | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    definitions: list[tuple[str, str]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    finished: bool = False  # finish() returned: W&B confirmed the upload
    exit_code: int | None = None
    preempting: bool = False  # marked preempting: the job goes on
    abandoned: bool = False  # cut off before finish(): nothing more of it is sent
    finish_state: bool = False  # opened to set the run's state at finish (a shared-mode writer leaves it alone)
    steps: list[int | None] = field(default_factory=list)  # the step each row was logged at (offline mode)


@dataclass
class StandIn:
    """Opens recording runs; ``fail_next`` makes the next uploads' finish fail as an unreachable W&B would."""

    uploads: list[Upload] = field(default_factory=list)
    fail_next: int = 0
    refuse_target: bool = False  # W&B refuses the run's target when the run is opened (a 403, say)

    def open(self, target: Target, name: str | None, mode: str, directory: Path, **options: Any) -> RecordingRun:
        if self.refuse_target:
            raise TargetRefusedError(f"W&B refused opening W&B run {target.wandb_id!r} (HTTP 403): permission denied")
        upload = Upload(target, name, options.get("config"), finish_state=options.get("finish_state", False))
        self.uploads.append(upload)
        failing = self.fail_next > 0
        self.fail_next -= failing
        return RecordingRun(upload, failing)

    def confirmed_rows(self) -> list[dict[str, Any]]:
        return [row for upload in self.uploads if upload.finished for row in upload.rows]


class RecordingRun:
    def __init__(self, upload: Upload, failing: bool) -> None:
        self.upload, self.failing = upload, failing

    @property
    def target(self) -> Target:
        return replace(self.upload.target, project=self.upload.target.project or "uncategorized")

    @property
    def offline_dir(self) -> str | None:
        return None

    def define_metric(self, key: str, step_metric: str) -> None:
        self.upload.definitions.append((key, step_metric))

    def update_summary(self, summary: dict[str, Any]) -> None:
        self.upload.summary.update(summary)

    def log(self, row: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        if any(key.endswith("/refused") for key in row):  # what wandb refuses of a row's data
            raise RowRefused(f"wandb refused the row: {sorted(row)}")
        self.upload.rows.append(dict(row))
        self.upload.steps.append(step)
        return {}

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        yield

    def keep_pace(self) -> None:
        pass

    def mark_preempting(self) -> None:
        self.upload.preempting = True

    def abandon(self) -> None:
        self.upload.abandoned = True

    def finish(self, exit_code: int | None = None) -> None:
        if self.failing:
            raise UploadError("W&B could not be reached (the stand-in's injected failure)")
        self.upload.finished, self.upload.exit_code = True, exit_code


def sync_in_process(
    buffer: Path,
    stand_in: StandIn,
    max_records: int | None = None,
    run: str | None = None,
    overrides: Target | None = None,
    mode: str = "online",
    more_soon: bool = False,
) -> walbuf.SyncResult:
    located = open_buffer(buffer)
    overrides = overrides or Target()
    with contextlib.suppress(UploadError):
        choices = PassChoices(
            run,
            overrides,
            mode,
            buffer.parent / "wandb",
            Budget(max_records, None),
            open_run=stand_in.open,
            more_soon=more_soon,
        )
        return sync_pass(located, choices)
    return walbuf.SyncResult(runs=())


def steps(rows: list[dict[str, Any]], writer: str) -> list[int]:
    return [row[f"{writer}/step"] for row in rows if f"{writer}/step" in row]


@pytest.fixture
def buffer(tmp_path):
    return tmp_path / "b.db"


def test_a_sync_hands_each_pending_record_to_the_run_once_in_commit_order(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a, walbuf.Writer(buffer, writer="b") as b:
        for i in range(3):
            a.log({"x": i})
            b.log({"y": i})
    result = sync_in_process(buffer, stand_in)
    assert result.runs[0].possibly_duplicated == 0  # no earlier upload could have delivered any
    rows = stand_in.confirmed_rows()
    assert [(next(iter(r)).split("/")[0], r.get("a/x", r.get("b/y"))) for r in rows] == [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
        ("a", 2),
        ("b", 2),
    ]


def test_a_second_sync_with_nothing_new_opens_no_run(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        a.config({"lr": 0.1})
        a.log({"x": 0})
        sync_in_process(buffer, stand_in)
        assert len(stand_in.uploads) == 1 and stand_in.uploads[0].config == {"lr": 0.1}
        result = sync_in_process(buffer, stand_in)
    assert result.runs == () and len(stand_in.uploads) == 1


def test_a_config_set_after_a_sync_is_sent_by_the_next_even_with_no_new_records(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        a.log({"x": 0})
        sync_in_process(buffer, stand_in)
        a.config({"lr": 0.2})
        sync_in_process(buffer, stand_in)
    assert [u.config for u in stand_in.uploads] == [{}, {"lr": 0.2}]


def test_a_failed_upload_advances_nothing_and_the_next_sends_it_all(buffer):
    stand_in = StandIn(fail_next=1)
    with walbuf.Writer(buffer, writer="a") as a:
        for i in range(3):
            a.log({"x": i})
        sync_in_process(buffer, stand_in)
        assert stand_in.confirmed_rows() == [] and walbuf.status(buffer).runs[0].pending == 3
        last = walbuf.status(buffer).runs[0].last_sync
        assert last is not None and last.status == "unreachable" and "W&B could not be reached" in (last.message or "")
        sync_in_process(buffer, stand_in)
    assert steps(stand_in.confirmed_rows(), "a") == [0, 1, 2]


def test_a_sync_cut_short_never_moves_a_cursor_back(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        for _ in range(3):
            a.log({"v": 1.0})
        with walbuf.Writer(buffer, writer="b") as b:  # a new writer's cursor starts past every record there is
            b.log({"v": 1.0})
            before = synced_ids(buffer)
            sync_in_process(buffer, stand_in, max_records=1)
            after = synced_ids(buffer)
    assert after["a"] == 1 and after["b"] == before["b"] == 3


def test_every_run_of_the_buffer_is_uploaded_into_its_own_w_and_b_run(buffer):
    stand_in = StandIn()
    for run in ("exp1", "exp2"):
        with walbuf.Writer(buffer, writer="a", run=run) as a:
            a.log({"x": 0})
    result = sync_in_process(buffer, stand_in)
    assert [r.run for r in result.runs] == ["exp1", "exp2"]
    assert len({u.target.wandb_id for u in stand_in.uploads}) == 2


def test_the_w_and_b_run_is_named_when_it_is_made_and_never_again(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a", run="exp1") as a:
        a.log({"x": 0})
        sync_in_process(buffer, stand_in)
        a.log({"x": 1})
        sync_in_process(buffer, stand_in)
    assert [u.name for u in stand_in.uploads] == ["exp1", None]  # a rename made in W&B stays


def test_a_sync_leaves_its_entry_as_the_runs_last_sync(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a", run="exp1") as a:
        for i in range(2):
            a.log({"x": i})
        sync_in_process(buffer, stand_in)
    last = walbuf.status(buffer).runs[0].last_sync
    assert last is not None and (last.status, last.records) == ("ok", 2)


def test_the_last_sync_of_one_process_counts_every_upload_it_made(buffer):
    # a sync --follow: one upload a pass, each of what logged since
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a", run="exp1") as a:
        for i in range(20):
            a.log({"x": i})
            sync_in_process(buffer, stand_in)
    last = walbuf.status(buffer).runs[0].last_sync
    assert last is not None and (last.status, last.records) == ("ok", 20)


def test_a_dry_run_after_everything_was_sent_plans_nothing(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a", run="exp1") as a:
        a.log({"x": 0})
        sync_in_process(buffer, stand_in)
        assert walbuf.sync(buffer, dry_run=True).runs == ()


def test_a_dry_run_reports_what_is_pending_and_writes_nothing(buffer):
    with walbuf.Writer(buffer, writer="a", run="exp1") as a:
        for i in range(3):
            a.log({"x": i})
    before = buffer.read_bytes()
    (planned,) = walbuf.sync(buffer, dry_run=True).runs
    assert planned.records == 3
    assert walbuf.status(buffer).runs[0].last_sync is None and buffer.read_bytes() == before


@pytest.mark.parametrize("bound", [1, 2, 5])
def test_max_records_sends_exactly_that_many_in_order_and_the_next_sync_the_rest(buffer, bound):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a", run="exp1") as a:
        for i in range(7):
            a.log({"x": i})
        sync_in_process(buffer, stand_in, max_records=bound)
        assert steps(stand_in.confirmed_rows(), "a") == list(range(bound))
        sync_in_process(buffer, stand_in)
    assert steps(stand_in.confirmed_rows(), "a") == list(range(7))


def test_a_run_the_buffer_lacks_is_refused_naming_those_it_has(buffer):
    with walbuf.Writer(buffer, writer="a", run="exp1") as a:
        a.log({"x": 0})
    with pytest.raises(walbuf.ConfigError, match=r"no run 'nope' .* \(runs: 'exp1'\)"):
        walbuf.sync(buffer, run="nope", dry_run=True)


def test_a_follow_of_one_run_uploads_it_once_it_exists_and_waits_before(buffer):
    stand_in = StandIn()

    def follow_pass() -> walbuf.SyncResult:  # as walbuf.follow syncs: a run no writer made yet is no error
        choices = PassChoices(
            "exp1", directory=buffer.parent / "wandb", more_soon=True, missing_ok=True, open_run=stand_in.open
        )
        return sync_pass(open_buffer(buffer), choices)

    with walbuf.Writer(buffer, writer="a", run="other") as a:
        a.log({"x": 0})
    assert follow_pass().runs == ()
    with walbuf.Writer(buffer, writer="a", run="exp1") as a:
        a.log({"x": 0})
        assert [r.run for r in follow_pass().runs] == ["exp1"]


def test_a_w_and_b_run_id_for_a_buffer_of_several_runs_needs_the_run(buffer):
    for run in ("exp1", "exp2"):
        with walbuf.Writer(buffer, writer="a", run=run) as a:
            a.log({"x": 0})
    with pytest.raises(walbuf.ConfigError, match="choose one with --run NAME"):
        walbuf.sync(buffer, run_id="abc123", dry_run=True)
    assert [r.run for r in walbuf.sync(buffer, run="exp2", run_id="abc123", dry_run=True).runs] == ["exp2"]


def test_a_target_w_and_b_refused_is_not_used_again_until_a_sync_gives_another(buffer):
    stand_in = StandIn(refuse_target=True)
    with walbuf.Writer(buffer, writer="a", run="exp1", project="theirs") as a:
        a.log({"x": 0})
    with pytest.raises(TargetRefusedError):
        sync_in_process(buffer, stand_in)
    stand_in.refuse_target = False
    with pytest.raises(TargetRefusedError, match="give another with --project"):
        sync_in_process(buffer, stand_in)
    assert stand_in.uploads == []
    sync_in_process(buffer, stand_in, overrides=Target(project="mine"))
    assert {u.target.project for u in stand_in.uploads} == {"mine"}  # the rows' upload, then the finishing one
    assert steps(stand_in.confirmed_rows(), "a") == [0]
    assert walbuf.status(buffer).runs[0].project == "mine"  # kept for the syncs after


def test_a_run_synced_offline_goes_online_only_into_a_new_w_and_b_run(buffer, tmp_path):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a", run="exp1") as a:
        a.log({"x": 0})
        sync_in_process(buffer, stand_in, mode="offline")
        a.log({"x": 1})
    with pytest.raises(walbuf.ConfigError, match="`wandb sync` of an offline run writes a non-shared history"):
        sync_in_process(buffer, stand_in)
    first = stand_in.uploads[0].target.wandb_id
    sync_in_process(buffer, stand_in, overrides=Target(wandb_id="fresh01"))
    assert [u.target.wandb_id for u in stand_in.uploads[1:]] == ["fresh01", "fresh01"]  # the rows, then the finish
    assert first != "fresh01" and steps(stand_in.uploads[1].rows, "a") == [1]


def test_while_the_job_goes_on_each_upload_marks_the_run_preempting(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        a.log({"x": 0})
        sync_in_process(buffer, stand_in)
        a.log({"x": 1})
        sync_in_process(buffer, stand_in, more_soon=True)  # a --follow: another pass comes within seconds
    sync_in_process(buffer, stand_in)  # the job is done: the run is finished instead
    assert [(u.preempting, u.exit_code) for u in stand_in.uploads] == [(True, None), (False, None), (False, 0)]
    assert [u.finish_state for u in stand_in.uploads] == [False, False, True]  # only the finishing one


def test_a_writer_that_failed_finishes_the_run_with_exit_code_1(buffer):
    stand_in = StandIn()
    a = walbuf.Writer(buffer, writer="a")
    a.log({"x": 0})
    a.close(failed=True)
    sync_in_process(buffer, stand_in)
    assert [u.exit_code for u in stand_in.uploads] == [None, 1]


def test_a_run_finished_with_exit_code_1_names_the_writers_that_failed_or_died(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="ok") as w:
        w.log({"x": 0})
    failed = walbuf.Writer(buffer, writer="bad")
    failed.log({"x": 0})
    failed.close(failed=True)
    (run,) = sync_in_process(buffer, stand_in).runs
    assert (run.finished, run.failed_writers) == (1, ("bad",))


def test_a_row_wandb_refuses_is_quarantined_and_the_rest_go_on(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        a.log({"x": 0})
        a.log({"refused": 1})
        a.log({"x": 2})
        result = sync_in_process(buffer, stand_in)
        assert steps(stand_in.confirmed_rows(), "a") == [0, 2]
        (quarantined,) = result.runs[0].quarantined
        assert (quarantined.writer, quarantined.step) == ("a", 1) and "wandb refused the row" in quarantined.reason
        assert [r.step for r in walbuf.read(buffer, quarantined=True)] == [1]
        assert sync_in_process(buffer, stand_in).runs == ()  # passed by the cursor: never sent again


def test_a_record_an_older_walbuf_let_in_is_quarantined_naming_the_rule(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        a.log({"x": 0})
        a.log({"x": 1})
    with sqlite3.connect(buffer) as conn:  # what log() refuses today: a key W&B reserves
        conn.execute("""UPDATE records SET metrics = '{"_runtime": 1}' WHERE step = 1""")
    result = sync_in_process(buffer, stand_in)
    assert steps(stand_in.confirmed_rows(), "a") == [0]
    (quarantined,) = result.runs[0].quarantined
    assert "_runtime" in quarantined.reason and "nothing was written" not in quarantined.reason


def test_a_config_key_set_again_with_another_value_is_reported_and_the_later_value_sent(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a, walbuf.Writer(buffer, writer="b") as b:
        a.config({"lr": 0.1})
        b.config({"lr": 0.2})
        a.log({"x": 0})
        result = sync_in_process(buffer, stand_in)
        (change,) = result.runs[0].config_changes
        assert (change.key, change.old_value, change.new_value) == ("lr", 0.1, 0.2)
        assert stand_in.uploads[0].config == {"lr": 0.2}
        a.log({"x": 1})
        assert sync_in_process(buffer, stand_in).runs[0].config_changes == ()  # reported once


@pytest.mark.parametrize(
    ("planted", "key", "why"),
    [
        ("UPDATE config_entries SET key = '_wandb' WHERE key = 'depth'", "_wandb", "reserves for itself"),
        ("UPDATE config_entries SET value = '{not json' WHERE key = 'depth'", "depth", "not JSON walbuf writes"),
    ],
    ids=["a key W&B reserves", "a value that is not JSON"],
)
def test_a_config_entry_w_and_b_would_refuse_is_left_out_once_with_the_reason(buffer, planted, key, why):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        a.config({"lr": 0.1, "depth": 3})
        a.log({"x": 0})
        with sqlite3.connect(buffer) as conn:  # a buffer is untrusted input: as an older walbuf let it in
            conn.execute(planted)
        (refused,) = sync_in_process(buffer, stand_in).runs[0].refused_settings
        assert (refused.kind, refused.key) == ("config", key) and why in refused.reason
        assert "nothing was stored" not in refused.reason
        a.log({"x": 1})
        assert sync_in_process(buffer, stand_in).runs[0].refused_settings == ()  # said once
    assert stand_in.uploads[0].config == {"lr": 0.1}


def test_offline_rows_number_on_across_syncs(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        for i in range(2):
            a.log({"x": i})
        sync_in_process(buffer, stand_in, mode="offline")
        a.log({"x": 2})
        sync_in_process(buffer, stand_in, mode="offline")
    assert [u.steps for u in stand_in.uploads[:2]] == [[0, 1], [2]]


def test_the_summary_holds_each_keys_last_value_and_the_summary_calls_over_them(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        a.log({"loss": 0.5})
        a.log({"loss": 0.25})
        a.summary({"best": 0.25})
        sync_in_process(buffer, stand_in)
    summary = stand_in.uploads[0].summary
    assert summary["a/loss"] == 0.25 and summary["best"] == 0.25 and summary["a/step"] == 1


@pytest.mark.parametrize(
    ("argument", "value", "says"),
    [
        ("max_records", 0, "max_records must be a positive int"),
        ("max_records", True, "max_records must be a positive int"),
        ("max_records", 2.0, "max_records must be a positive int"),
        ("max_seconds", 0, "max_seconds must be positive"),
        ("max_seconds", float("nan"), "max_seconds must be a finite number of seconds"),
        ("max_seconds", -1, "max_seconds must be a finite number of seconds"),
        ("wait", float("inf"), "wait must be a finite number of seconds"),
        ("wait", "5", "wait must be a finite number of seconds"),
        ("mode", "shared", "mode must be one of"),
    ],
)
def test_a_bad_argument_to_sync_is_refused_naming_it_and_nothing_changes(buffer, argument, value, says):
    with walbuf.Writer(buffer, writer="a") as a:
        a.log({"x": 0})
    before = buffer.read_bytes()
    with pytest.raises(walbuf.ConfigError, match=says):
        walbuf.sync(buffer, **{argument: value})
    assert buffer.read_bytes() == before and walbuf.status(buffer).runs[0].pending == 1


@pytest.mark.parametrize(
    ("argument", "value", "says"),
    [("interval", 0, "interval must be positive"), ("renew_every", 0, "renew_every must be a positive int")],
)
def test_a_bad_argument_to_follow_is_refused_naming_it(buffer, argument, value, says):
    with pytest.raises(walbuf.ConfigError, match=says):
        walbuf.follow(buffer, **{argument: value})


def test_a_sync_of_more_records_than_one_batch_sends_each_once_in_order(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        for i in range(1201):  # more than BATCH (500) records in one read chunk
            a.log({"x": i})
        sync_in_process(buffer, stand_in)
    assert steps(stand_in.confirmed_rows(), "a") == list(range(1201))


def test_the_progress_callback_counts_every_record_handled_and_the_result_each_writers(buffer):
    stand_in, reported = StandIn(), []
    with walbuf.Writer(buffer, writer="a") as a, walbuf.Writer(buffer, writer="b") as b:
        for i in range(600):
            (a if i % 3 else b).log({"x": i})
        choices = PassChoices(directory=buffer.parent / "wandb", progress=reported.append, open_run=stand_in.open)
        result = sync_pass(open_buffer(buffer), choices)
    assert sum(reported) == 600 and len(reported) >= 2  # after each batch
    assert result.runs[0].per_writer == {"a": 400, "b": 200}


def test_a_record_whose_step_axis_value_is_not_a_step_is_quarantined(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        a.log({"x": 0})
        a.log({"x": 1})
    with sqlite3.connect(buffer) as conn:  # as an older walbuf let it in
        conn.execute("""UPDATE records SET metrics = '{"x": 1, "step": -4}' WHERE step = 1""")
    result = sync_in_process(buffer, stand_in)
    (quarantined,) = result.runs[0].quarantined
    assert "step axis" in quarantined.reason and steps(stand_in.confirmed_rows(), "a") == [0]


def test_a_summary_over_w_and_bs_line_limit_leaves_its_largest_values_out_and_says_so(buffer):
    stand_in = StandIn()
    big = 999_000  # under the limit of one value; eleven pass the line, ten fit
    assert 10 * big < MAX_LINE_BYTES - 1024 < 11 * big
    with walbuf.Writer(buffer, writer="a") as a:
        a.log({"x": 0})
        a.summary({f"k{i}": "s" * (big - 10 + i) for i in range(11)})
        result = sync_in_process(buffer, stand_in)
    (left_out,) = result.runs[0].refused_settings
    assert (left_out.kind, left_out.key) == ("summary", "k10")  # the largest
    assert "k10" not in stand_in.uploads[0].summary and "k0" in stand_in.uploads[0].summary


def test_after_a_failed_upload_the_next_says_how_many_records_w_and_b_may_hold_twice(buffer):
    stand_in = StandIn(fail_next=1)
    with walbuf.Writer(buffer, writer="a") as a:
        for i in range(3):
            a.log({"x": i})
        sync_in_process(buffer, stand_in)  # handed all three to wandb, then failed
        a.log({"x": 3})
        (again,) = sync_in_process(buffer, stand_in).runs
    assert (again.records, again.possibly_duplicated) == (4, 3)


def test_a_new_offline_run_numbers_its_rows_from_0(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        for i in range(2):
            a.log({"x": i})
        sync_in_process(buffer, stand_in, mode="offline")
        a.log({"x": 2})
        sync_in_process(buffer, stand_in, overrides=Target(wandb_id="online01"))
        a.log({"x": 3})
        sync_in_process(buffer, stand_in, mode="offline", overrides=Target(wandb_id="offline02"))
    assert [u.steps for u in stand_in.uploads[:3]] == [[0, 1], [None], [0]]


def test_the_entry_of_a_syncer_that_died_is_closed_as_interrupted_and_its_records_counted(buffer):
    stand_in = StandIn()
    with walbuf.Writer(buffer, writer="a") as a:
        for i in range(3):
            a.log({"x": i})
    with sqlite3.connect(buffer) as conn:  # what a syncer killed mid-upload leaves
        conn.execute(
            "INSERT INTO syncs (run_id, mode, status, started_at, last_id, records, host, pid)"
            " VALUES (1, 'online', 'running', 0, 3, 3, 'h', 1)"
        )
    (report,) = sync_in_process(buffer, stand_in).runs
    assert report.possibly_duplicated == 3
    with sqlite3.connect(buffer) as conn:
        assert conn.execute("SELECT status, message FROM syncs WHERE id = 1").fetchone() == (
            "interrupted",
            "the syncer died during the upload",
        )


# One operation of a job and its syncs: a writer logs a record, or a sync
# runs (bounded to a few records, or not; its upload failing, or not).
operations = st.lists(
    st.one_of(
        st.tuples(st.just("log"), st.sampled_from(["a", "b", "c"])),
        st.tuples(st.just("sync"), st.one_of(st.none(), st.integers(1, 4)), st.booleans()),
    ),
    max_size=30,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations)
def test_over_any_logs_and_syncs_cursors_only_advance_and_w_and_b_confirms_each_record_once_in_order(
    tmp_path_factory, ops
):
    buffer = tmp_path_factory.mktemp("ops") / "b.db"
    stand_in = StandIn()
    logged: dict[str, list[int]] = {}
    writers: dict[str, walbuf.Writer] = {}
    try:
        for op in ops:
            if op[0] == "log":
                name = op[1]
                if name not in writers:
                    writers[name] = walbuf.Writer(buffer, writer=name)
                logged.setdefault(name, []).append(writers[name].log({"v": 1.0}))
                continue
            if not buffer.exists():
                continue
            before = synced_ids(buffer)
            stand_in.fail_next = int(op[2])
            sync_in_process(buffer, stand_in, max_records=op[1])
            stand_in.fail_next = 0  # (left set by a sync that had nothing to upload)
            for name, cursor in synced_ids(buffer).items():
                assert cursor >= before[name], f"writer {name}'s cursor went back: {before[name]} -> {cursor}"
        if buffer.exists():
            sync_in_process(buffer, stand_in)  # and one that completes
    finally:
        for w in writers.values():
            w.close()
    for name, steps_logged in logged.items():
        assert steps(stand_in.confirmed_rows(), name) == steps_logged


def synced_ids(buffer: Path) -> dict[str, int]:
    """Each writer's sync cursor, as the buffer holds it."""
    conn = sqlite3.connect(f"file:{buffer}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT name, synced_id FROM writers"))
    finally:
        conn.close()
