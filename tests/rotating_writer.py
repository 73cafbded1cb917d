"""A writer that keeps logging while its shards rotate, until its stdin closes.

Usage: rotating_writer.py BUFFER WRITER   (host: $WALBUF_HOST; rotation: $WALBUF_ROTATE_SECONDS)

Prints "started" once its first record is committed, then logs {"i": 0, 1,
...} with a pause of 2 ms between records (a steady trickle, not a flood)
until stdin closes; then closes the writer and prints "logged N".
"""

import selectors
import sys

import walbuf

buffer, name = sys.argv[1], sys.argv[2]
waiting = selectors.DefaultSelector()
waiting.register(sys.stdin, selectors.EVENT_READ)
with walbuf.Writer(buffer, writer=name, run="exp") as w:
    w.log({"i": 0})
    print("started", flush=True)
    n = 1
    while not waiting.select(timeout=0.002):  # stdin closed: readable (at its end)
        w.log({"i": n})
        n += 1
print(f"logged {n}", flush=True)
