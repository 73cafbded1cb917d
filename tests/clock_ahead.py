"""Run `python -m MODULE ARGS...` in this process with its wall clock SECONDS ahead (a host whose clock runs ahead).

Usage: clock_ahead.py SECONDS PYTHON -m MODULE [ARGS...]

A fault from outside walbuf: time.time() (and what reads it) answers SECONDS
later than the machine's clock; monotonic clocks are untouched.
"""

import runpy
import sys
import time

ahead = float(sys.argv[1])
_python, flag, module, *args = sys.argv[2:]
assert flag == "-m", "usage: clock_ahead.py SECONDS PYTHON -m MODULE [ARGS...]"
_real = time.time
time.time = lambda: _real() + ahead
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
