"""A process that forks while walbuf's expiry thread is letting go of its writer's shard.

Usage: fork_while_letting_go.py BUFFER   (host: $WALBUF_HOST, rotation age: $WALBUF_ROTATE_SECONDS)

For each line on stdin, logs one record and prints the live shard it is in
(a new one once the last expired). On "fork": waits until the writer's
lease on that shard is gone (the expiry thread is letting go of it), then
forks; the child logs as a writer of its own and exits through atexit. The
parent prints "child EXITCODE" and closes its writer. walbuf's debug log
goes to stderr.
"""

import logging
import os
import sys
import threading
from pathlib import Path

import walbuf
from walbuf.directory.layout import Layout
from walbuf.directory.lease import in_use

logging.basicConfig(stream=sys.stderr, level=logging.DEBUG, format="%(message)s")
buffer = sys.argv[1]
live = Path(buffer) / "live" / os.environ["WALBUF_HOST"]
w = walbuf.Writer(buffer, writer="parent", run="exp")
shard = None
for line in sys.stdin:
    if line.strip() != "fork":
        w.log({"i": 0})
        shard = max(live.glob("*.db"))
        print(shard, flush=True)
        continue
    while in_use(
        Layout(Path(buffer)), shard
    ):  # the expiry thread releases the lease, then waits for the host's rotate.lock
        threading.Event().wait(0.01)
    pid = os.fork()
    if pid == 0:
        with walbuf.Writer(buffer, writer="child", run="exp") as child:
            child.log({"i": 0})
        sys.exit(0)  # atexit runs, the parent's writer's close() too
    _, status = os.waitpid(pid, 0)
    print(f"child {os.waitstatus_to_exitcode(status)}", flush=True)
    break
w.close()
