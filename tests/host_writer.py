"""A writer on a simulated host: logs N records, says so, then closes or stays open.

Usage: host_writer.py BUFFER WRITER N close|stay

The host is $WALBUF_HOST. Prints "logged N" once every record is committed
(on stdout and on stderr);
with "stay" it then keeps the writer open, idle, until its stdin closes (or
it is killed). walbuf's log goes to stderr.
"""

import logging
import sys

import walbuf

logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")

buffer, writer, n, then = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
w = walbuf.Writer(buffer, writer=writer, run="exp")
for i in range(n):
    w.log({"i": i})
print(f"logged {n}", flush=True)
print(f"logged {n}", file=sys.stderr, flush=True)  # what walbuf logs after this comes after it there
if then == "stay":
    sys.stdin.read()
w.close()
