"""A writer process for the kill -9 tests of test_crashes.py: logs until it is killed.

Usage: crash_writer.py BUFFER WRITER PAD

Prints ``opening`` before it opens the Writer, ``ready LAST`` once it is open
(LAST: the writer's last step, -1 for a new writer), then the step of every
record after log() returned for it: a printed step is an acknowledged one.
Each record is ``{"seq": <the step it should get>, "pad": "x" * PAD}``, so
that a reader can tell a record that went to the wrong step.
"""

import sys

import walbuf

buffer, name, pad = sys.argv[1], sys.argv[2], "x" * int(sys.argv[3])
print("opening", flush=True)
writer = walbuf.Writer(buffer, writer=name, run="crash")
last = writer.last_step
print("ready", -1 if last is None else last, flush=True)
seq = 0 if last is None else last + 1
while True:
    print(writer.log({"seq": seq, "pad": pad}), flush=True)
    seq += 1
