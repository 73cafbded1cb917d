"""A state machine over appends, syncs, crashed syncs and server outages.

Invariant: after a final successful sync, the W&B fake holds every appended
record, per writer in order, none lost (a crashed or failed upload may add
copies, never remove one).
"""

from __future__ import annotations

import pytest
from conftest import fresh_buffer
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import walbuf
from walbuf.syncer.wandb import run as wandb_adapter

pytestmark = [pytest.mark.backends("sqlite", "postgresql"), pytest.mark.slow]

WRITERS = ("rank-0", "rank-1", "eval")


class Crash(BaseException):
    """The syncer dies: after its upload is logged as running, before anything is confirmed."""


def _crash(_run: object) -> None:
    raise Crash


_DEFAULT_RETRIES = wandb_adapter.retry_settings


def _fast_retries() -> dict[str, object]:
    """One retry, one second apart: wandb-core truncates waits to whole seconds (0 = its default)."""
    fast = _DEFAULT_RETRIES()
    for key in fast:
        if key.endswith("_max"):
            fast[key] = 1
        elif key.endswith("_seconds"):
            fast[key] = 1
    return fast


class SyncMachine(RuleBasedStateMachine):
    server = None  # set by the test
    backend = "sqlite"  # set by the test

    @initialize()
    def open_buffer(self):
        self.tmp = fresh_buffer(self.backend)
        self.buffer = self.tmp.__enter__()
        self.appended = {w: [] for w in WRITERS}
        self.counter = 0
        walbuf.Writer(self.buffer, writer=WRITERS[0], run="r").close()  # the buffer exists, empty

    @rule(writer=st.sampled_from(WRITERS), n=st.integers(1, 4))
    def append(self, writer, n):
        with walbuf.Writer(self.buffer, writer=writer, run="r") as w:
            for _ in range(n):
                self.appended[writer].append((w.log({"n": self.counter}), self.counter))
                self.counter += 1

    @rule()
    def sync(self):
        walbuf.sync(self.buffer)

    @rule()
    def crashed_sync(self):
        try:
            walbuf.sync(self.buffer, on_run=_crash)
        except Crash:
            pass

    @rule()
    def sync_during_outage(self):
        self.server.fail_with(500, "file_stream")
        try:
            walbuf.sync(self.buffer)
        except walbuf.UploadError:
            pass
        else:  # nothing was pending: no upload was tried
            assert all(w.pending == 0 for r in walbuf.status(self.buffer).runs for w in r.writers)
        finally:
            self.server.fail_with(None)

    @invariant()
    def nothing_pending_is_lost_from_the_buffer(self):
        assert sum(r.records for r in walbuf.status(self.buffer).runs) == self.counter

    def teardown(self):
        try:
            if self.counter:
                walbuf.sync(self.buffer)
                (run,) = walbuf.status(self.buffer).runs
                fake = self.server.run(run.wandb_id)
                for writer, expected in self.appended.items():
                    seen, first = set(), []
                    for row in fake.history:
                        key = (row.get(f"{writer}/step"), row.get(f"{writer}/n"))
                        if key[0] is not None and key not in seen:
                            seen.add(key)
                            first.append(key)
                    assert first == expected, writer
        finally:
            self.tmp.__exit__(None, None, None)


@pytest.mark.filterwarnings("ignore")
def test_sync_state_machine(wandb_session_server, backend, tmp_path, monkeypatch):
    for name, value in wandb_session_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setattr(wandb_adapter, "retry_settings", _fast_retries)
    SyncMachine.server = wandb_session_server
    SyncMachine.backend = backend
    run_state_machine_as_test(
        SyncMachine,
        settings=settings(
            max_examples=20,
            stateful_step_count=10,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
