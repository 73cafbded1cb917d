"""What confirms an online upload: wandb-core's own account, in its internal log, of W&B's answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Account:
    """wandb-core's account of one run's file_stream so far, read from its internal log as it grows.

    The evidence is positive: wandb-core's file_stream logs each request it
    makes ("filestream: sending request", with the history lines it carries
    and whether it finishes the run) and, only once W&B answered it with
    success, "filestream: request sent" with the HTTP status (wandb 0.31,
    core filestream/filestreamimpl.go send() and logRequestSummary; requests
    go one at a time, transmitloop.go). Only this run's stream counts: the
    lines after its last "stream: starting" (the log is opened for
    appending, and two uploads of one run in one second share a run
    folder). A log that is missing, empty, cut off or in a form this does
    not know accounts for nothing.

    Each :meth:`read` takes in the whole lines written since the last one,
    so a run kept open for many passes is read once, not once per pass.
    """

    def __init__(self, log: Path) -> None:
        self.log = log
        self._offset = 0
        self.found = False  # the log exists
        self.started = False  # it holds this run's "stream: starting"
        self.errors = False  # an ERROR line since: failures.upload_failure says what it is
        self._requests: list[dict[str, Any]] = []  # each: the request's own log line, "status" added once answered

    def read(self) -> None:
        """Take in the whole lines wandb-core wrote since the last read (a line under way waits for the next)."""
        try:
            with self.log.open("rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return
        self.found = True
        whole = data.rfind(b"\n") + 1
        self._offset += whole
        for line in data[:whole].decode("utf-8", errors="replace").splitlines():
            self._take(line)

    def _take(self, line: str) -> None:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            return  # a line cut off (the log's disk full): it confirms nothing
        if not isinstance(entry, dict):
            return
        message = entry.get("msg")
        if message == "stream: starting":
            self.started, self.errors, self._requests = True, False, []
        elif str(entry.get("level", "")).startswith("ERROR"):
            # "ERROR+4" too: slog's name for wandb-core's fatal level, at which
            # the file_stream logs giving up (core observability/logging.go
            # LevelFatal, filestream.go logFatalAndStopWorking).
            self.errors = True
        elif message == "filestream: sending request":
            self._requests.append(entry)
        elif message == "filestream: request sent" and self._requests:
            self._requests[-1]["status"] = str(entry.get("status", ""))

    def taken(self) -> int:
        """History rows W&B answered with success so far."""
        return sum(
            r["history_lines"]
            for r in self._requests
            if r.get("status", "").startswith("2") and isinstance(r.get("history_lines"), int)
        )

    def missing(self, rows: int, finishing: bool) -> str | None:
        """Why the account does not show W&B taking the whole upload (None: it does).

        The upload counts as taken when every request was answered 2xx, the
        answered ones carry at least the ``rows`` handed over, and, when
        ``finishing``, one of them carried the run's finish.
        """
        if not self.found:
            return "wandb-core wrote no log of the upload, which is where it accounts for what W&B took"
        if not self.started:
            return "wandb-core's log holds no account of the upload (it is empty, or in a form walbuf does not know)"
        answered = [r for r in self._requests if r.get("status", "").startswith("2")]
        if len(answered) < len(self._requests):
            return f"W&B answered {len(answered)} of wandb-core's {len(self._requests)} file_stream requests"
        lines = self.taken()
        if lines < rows:
            return f"W&B took {lines:,} of the {rows:,} history rows handed to wandb"
        if finishing and not any(r.get("complete") is True for r in answered):
            return "W&B was not seen to take the run's finish"
        return None
