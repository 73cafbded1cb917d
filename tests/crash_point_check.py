"""What test_crash_points.py reads of a buffer after a kill, in a process of its own (a hang fails by a timeout).

Usage: crash_point_check.py BUFFER [WRITER:AXIS[:PROJECT] ...]

Prints one JSON line, :func:`examine`'s: what walbuf's public functions
read, changing nothing. Then, for each WRITER given, it opens that writer
again (run "crash"), logs one record and closes it, and prints a second
line: per writer the step log() returned. A buffer a crash left damaged
shows here too: a writer that cannot open it or does not continue its
steps.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import walbuf

RUN = "crash"


def examine(buffer: str) -> dict[str, Any]:
    """``exists``: whether the location holds a buffer at all (a writer killed while it made one may leave none);
    ``records`` (per "RUN/WRITER": [step, metrics["seq"]], in the order read), ``status`` (walbuf.status's dict),
    ``doctor`` ([check, ok, detail] per finding), each None with the error's text in ``errors`` if it raised."""
    out: dict[str, Any] = {"errors": {}, "records": None, "status": None, "doctor": None}

    def attempt(name: str, read: Callable[[], Any]) -> None:
        try:
            out[name] = read()
        except Exception as exc:  # noqa: BLE001 - what failed is the finding
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()

    def records() -> dict[str, list[list[Any]]]:
        found: dict[str, list[list[Any]]] = {}
        for record in walbuf.read(buffer):
            found.setdefault(f"{record.run}/{record.writer}", []).append([record.step, record.metrics.get("seq")])
        return found

    path = Path(buffer)
    out["exists"] = path.is_dir() if buffer.endswith("/") else path.exists() and path.stat().st_size > 0
    if out["exists"]:
        attempt("records", records)
        attempt("status", lambda: walbuf.status(buffer).to_dict())
        attempt("doctor", lambda: [[f.check, f.ok, f.detail] for f in walbuf.doctor(buffer).findings])
    return out


def reopen(buffer: str, specs: list[str]) -> dict[str, int]:
    """Open each writer of ``specs`` (WRITER:AXIS[:PROJECT]) again, log one record; the step each logged."""
    steps = {}
    for spec in specs:
        name, axis, *project = spec.split(":")
        with walbuf.Writer(buffer, writer=name, run=RUN, step_axis=axis, project=project[0] if project else None) as w:
            steps[name] = w.log({"seq": 0 if w.last_step is None else w.last_step + 1})
    return steps


if __name__ == "__main__":
    print(json.dumps(examine(sys.argv[1])), flush=True)
    if sys.argv[2:]:
        print(json.dumps(reopen(sys.argv[1], sys.argv[2:])), flush=True)
