"""A writer process for tests/test_interrupts.py: logs, and logs again after each Ctrl-C, as a notebook user does.

Usage: interrupted_writer.py BUFFER RECORDS [fsync] [explicit] [fsize=BYTES]

Opens writer "w" of run "r" (``durability="fsync"`` with ``fsync``), then
logs RECORDS records ``{"seq": SEQ, "kSEQ//3": 1.0, "pad": "x" * TRIES}`` (a
new key every third record, so that some log() calls claim keys; TRIES, the
log() calls made for this SEQ so far, so that a record logged again is
longer): each again after a KeyboardInterrupt or a StorageError, with the
same SEQ, until its log() returns; with ``explicit``, at ``step=SEQ``. Every
exception caught is kept, traceback and all, as a notebook keeps the last
one (and with it every frame's locals): nothing a log() left behind is let
go by the garbage collector.

``fsize=BYTES`` (a directory buffer): from the start of the loop until the
first exception is caught, the live shard may not grow past BYTES more than
it holds (RLIMIT_FSIZE, SIGXFSZ ignored): the write that reaches the limit
writes part of its frame, the next fails with EFBIG. After that exception,
room is given back (the limit lifted), as a user frees space.

The loop is marked by a getppid() call before and after it, so that a
trace can count the syscalls it made. Then it prints ``done`` and a JSON
object: "acked", [SEQ, STEP] for each log() that returned; "caught", the
names of the exceptions caught. It waits for a line on stdin (meanwhile the
test looks at the buffer while the writer is still open), closes the writer,
and prints ``closed``.
"""

import collections
import json
import os
import resource
import signal
import sys
from pathlib import Path

import walbuf

buffer, records = sys.argv[1], int(sys.argv[2])
options = sys.argv[3:]
durability = "fsync" if "fsync" in options else "normal"
explicit = "explicit" in options
fsize = next((int(o.removeprefix("fsize=")) for o in options if o.startswith("fsize=")), None)

writer = walbuf.Writer(buffer, writer="w", run="r", durability=durability)
if fsize is not None:
    (shard,) = Path(buffer, "live").glob("*/*.log")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (shard.stat().st_size + fsize, resource.RLIM_INFINITY))
kept: list[BaseException] = []
acked: list[tuple[int, int]] = []
tries: collections.Counter[int] = collections.Counter()
os.getppid()  # the loop starts
while len(acked) < records:
    try:
        try:
            seq = len(acked)
            tries[seq] += 1
            metrics = {"seq": seq, f"k{seq // 3}": 1.0, "pad": "x" * tries[seq]}
            step = writer.log(metrics, step=seq if explicit else None)
            acked.append((seq, step))
        except (KeyboardInterrupt, walbuf.StorageError) as exc:
            kept.append(exc)
            if fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except KeyboardInterrupt as exc:  # a second one, while the first was being kept
        kept.append(exc)
os.getppid()  # the loop ended
print("done", json.dumps({"acked": acked, "caught": [type(e).__name__ for e in kept]}), flush=True)
sys.stdin.readline()
writer.close()
print("closed", flush=True)
