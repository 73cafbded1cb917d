"""`walbuf sync --follow` beside a 2-process job, against the fake W&B server (tests/wandb_server.py).

Two writer processes log one record each per second for --minutes; a
`walbuf sync --follow BUFFER` started before them streams the records into
the fake. Printed at the end:

- the delay from log() to the record's arrival at the server (median, max),
  the arrival being when this script first saw the row (it looks every 0.2 s);
- the resident memory of the follow process and of its wandb-core after
  the first minute, every --sample-minutes after it, and at the end;
- the W&B run's state through the job, as the fake models it (each change,
  and when), and the follow's exit code.

    python scripts/follow_demo.py [--minutes 10] [--sample-minutes 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from wandb_server import FakeWandb  # noqa: E402

WRITER = """
import sys, time, walbuf
end = time.time() + float(sys.argv[3])
with walbuf.Writer(sys.argv[1], writer=sys.argv[2], run="exp") as w:
    while time.time() < end:
        w.log({"logged_at": time.time()})
        time.sleep(1)
"""


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def core_of(pid: int) -> int | None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for child in (task / "children").read_text().split():
                if b"wandb-core" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return int(child)
        except OSError:
            continue
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument(
        "--sample-minutes", type=float, default=10.0, help="memory is sampled this often after the first minute"
    )
    args = parser.parse_args()
    seconds = args.minutes * 60
    with FakeWandb() as server, tempfile.TemporaryDirectory() as tmp:
        buffer = str(Path(tmp) / "exp.db")
        env = {**os.environ, **server.env()}
        follow = subprocess.Popen(
            [sys.executable, "-m", "walbuf", "sync", "--follow", "--quiet", buffer],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        writers = [
            subprocess.Popen([sys.executable, "-c", WRITER, buffer, f"rank-{i}", str(seconds)], env=env)
            for i in range(2)
        ]
        seen: dict[tuple[str, float], float] = {}
        states: list[tuple[float, str]] = []
        memory: dict[str, tuple[int | None, int | None]] = {}  # when -> RSS of follow, of its wandb-core
        sampled = 0
        start = time.time()
        while follow.poll() is None:
            now = time.time()
            for fake_run in list(server.runs.values()):
                for row in list(fake_run.history):
                    for key, value in row.items():
                        if key.endswith("/logged_at") and (key, value) not in seen:
                            seen[(key, value)] = now
                state = server.state(fake_run.id)
                if not states or states[-1][1] != state:
                    states.append((now - start, state))
            if now - start > 60 + sampled * args.sample_minutes * 60 and now - start < seconds - 5:
                core = core_of(follow.pid)
                memory[f"{(now - start) / 60:.0f} min"] = (rss_kib(follow.pid), rss_kib(core) if core else None)
                sampled += 1
            if now - start < seconds - 5:
                core = core_of(follow.pid)
                memory["the end"] = (rss_kib(follow.pid), rss_kib(core) if core else None)
            time.sleep(0.2)
        for writer in writers:
            writer.wait()
        stderr = follow.stderr.read() if follow.stderr else ""
    delays = sorted(arrived - logged for (_, logged), arrived in seen.items())
    print(f"records logged and arrived: {len(delays)} over {args.minutes:g} minutes, 2 writers")
    print(f"delay from log() to arrival: median {statistics.median(delays):.1f} s, max {max(delays):.1f} s")
    for when, (follow_kib, core_kib) in memory.items():
        print(f"memory at {when}: follow {follow_kib} KiB, wandb-core {core_kib} KiB")
    print("run state: " + ", ".join(f"{state} at {t:.0f} s" for t, state in states))
    print(f"follow exit code: {follow.returncode}; stderr: {stderr.strip() or '(nothing)'}")


if __name__ == "__main__":
    main()
