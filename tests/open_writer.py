"""Open a Writer on a buffer, log one record, and say what happened, as one JSON line.

Usage: open_writer.py BUFFER WRITER RUN

Run by test_crashes.py in a process that may not write the buffer. Prints
``{"raised": null}`` if the record was logged, else the exception's class
name, whether it is a walbuf.WalbufError, and its message.
"""

import json
import sys

import walbuf

try:
    with walbuf.Writer(sys.argv[1], writer=sys.argv[2], run=sys.argv[3]) as writer:
        writer.log({"from": "a process that may not write"})
except Exception as exc:  # noqa: BLE001 - reporting whatever it is, is the point
    outcome = {
        "raised": type(exc).__name__,
        "walbuf_error": isinstance(exc, walbuf.WalbufError),
        "message": str(exc),
    }
else:
    outcome = {"raised": None}
print(json.dumps(outcome))
