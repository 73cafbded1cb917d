"""Run a command with a limit on the size of the files it writes: a write past it fails with EFBIG.

Usage: file_size_limit.py BYTES COMMAND [ARGS...]

A fault from outside walbuf: the kernel refuses to grow any file past BYTES
(RLIMIT_FSIZE), as a full disk or an exhausted quota would. SIGXFSZ is
ignored, so the write fails with an error instead of killing the process.
"""

import os
import resource
import signal
import sys

limit = int(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
os.execvp(sys.argv[2], sys.argv[2:])
