"""A writer that logs one record per line of stdin, until stdin closes; then it closes.

Usage: stdin_writer.py BUFFER WRITER RUN

Each line is an integer i: it logs {"i": i} and prints "logged i" once
log() returned. It prints "closed" after the writer closed.
"""

import sys

import walbuf

with walbuf.Writer(sys.argv[1], writer=sys.argv[2], run=sys.argv[3]) as writer:
    for line in sys.stdin:
        writer.log({"i": int(line)})
        print(f"logged {int(line)}", flush=True)
print("closed", flush=True)
