"""What confirms an online upload: wandb-core's own account, in its internal log, of W&B's answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def unconfirmed(log: Path, rows: int, finishing: bool) -> str | None:
    """Why wandb-core's own account of an online upload does not show W&B taking all of it (None: it does).

    The evidence is positive: wandb-core's file_stream logs each request it
    makes ("filestream: sending request", with the history lines it carries
    and whether it finishes the run) and, only once W&B answered it with
    success, "filestream: request sent" with the HTTP status (wandb 0.31,
    core filestream/filestreamimpl.go send() and logRequestSummary; requests
    go one at a time, transmitloop.go). The upload counts as confirmed when
    every request of this run's stream (the lines after its last "stream:
    starting": the log is opened for appending, and two uploads of one run
    in one second share a run folder) was answered 2xx, the answered ones
    carry at least the ``rows`` handed over, and, when ``finishing``, one
    of them carried the run's finish. A log that is missing, empty, cut off
    or in a form this does not know confirms nothing.
    """
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "wandb-core wrote no log of the upload, which is where it accounts for what W&B took"
    requests: list[dict[str, Any]] = []  # each: the request's own log line, "status" added once answered
    started = False
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut off (the log's disk full): it confirms nothing
        if not isinstance(entry, dict):
            continue
        message = entry.get("msg")
        if message == "stream: starting":
            started, requests = True, []
        elif message == "filestream: sending request":
            requests.append(entry)
        elif message == "filestream: request sent" and requests:
            requests[-1]["status"] = str(entry.get("status", ""))
    if not started:
        return "wandb-core's log holds no account of the upload (it is empty, or in a form walbuf does not know)"
    answered = [r for r in requests if r.get("status", "").startswith("2")]
    if len(answered) < len(requests):
        return f"W&B answered {len(answered)} of wandb-core's {len(requests)} file_stream requests"
    lines = sum(r["history_lines"] for r in answered if isinstance(r.get("history_lines"), int))
    if lines < rows:
        return f"W&B took {lines:,} of the {rows:,} history rows handed to wandb"
    if finishing and not any(r.get("complete") is True for r in answered):
        return "W&B was not seen to take the run's finish"
    return None
