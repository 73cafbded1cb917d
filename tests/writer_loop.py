"""A writer process for the kill -9 test: logs forever, printing each step after log() returns."""

import sys

import walbuf

writer = walbuf.init(sys.argv[1], writer="victim", run="crash")
print("ready", flush=True)
while True:
    step = walbuf.log({"value": 1.5, "text": "x" * 50})
    print(step, flush=True)
