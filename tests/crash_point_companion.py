"""Another writer process beside test_crash_points.py's writer: logs one record for each line its stdin gives.

Usage: crash_point_companion.py BUFFER

Opens writer "companion" of run "crash", then logs one record per line
read until its stdin closes, then closes the writer. It writes one line to
stdout after each call returned (in one write()): ``ready``, ``companion
STEP`` (an acknowledged record, holding ``{"seq": STEP}``), ``closed``.
The test feeds it a line for each record the writer under strace
acknowledges, so that the two log at once (in a SQLite buffer the
two processes contend for SQLite's write lock),
at the writer's pace, without a clock.
"""

import os
import sys

import walbuf


def said(line: str) -> None:
    os.write(1, f"{line}\n".encode())


with walbuf.Writer(sys.argv[1], writer="companion", run="crash") as writer:
    said("ready")
    for _ in sys.stdin:
        step = writer.log({"seq": 0 if writer.last_step is None else writer.last_step + 1})
        said(f"companion {step}")
said("closed")
