"""Benchmark: the cost of a sync does not grow with the number of keys a run has ever had.

A sync of ONE new record, on a run whose writer has logged 10,000 distinct
keys, against the same on a run of 10 keys, side by side in one run (rounds
alternate), into the test suite's fake W&B server. Each writer is declared
with one glob definition, so the ratio should stay near 1 (target <= 3x;
with one define_metric per key it was 63x).

    python scripts/bench_keys.py [--keys 10000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from wandb_server import FakeWandb  # noqa: E402

import walbuf  # noqa: E402


def prepare(buffer: Path, keys: int) -> walbuf.Writer:
    """A run whose writer logged ``keys`` distinct keys, all synced already; the writer stays open (training goes
    on)."""
    writer = walbuf.Writer(buffer, writer="w", run="bench")
    writer.log({f"layer{i}/grad_norm": float(i) for i in range(keys)})
    result = walbuf.sync(buffer, project="bench", entity="bench")
    assert result.records == 1, result
    return writer


def time_one_new_record(buffer: Path, writer: walbuf.Writer, round_: int) -> float:
    writer.log({"loss": 1.0 / (round_ + 1)})
    start = time.perf_counter()
    result = walbuf.sync(buffer)
    elapsed = time.perf_counter() - start
    assert result.records == 1, result
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, FakeWandb() as server:
        os.environ.update(server.env())
        os.environ["WANDB_DIR"] = tmp
        few, many = Path(tmp) / "few.db", Path(tmp) / "many.db"
        writers = {few: prepare(few, 10), many: prepare(many, args.keys)}
        times: dict[Path, list[float]] = {few: [], many: []}
        for round_ in range(args.rounds):
            for buffer in (few, many):
                times[buffer].append(time_one_new_record(buffer, writers[buffer], round_))
        for writer in writers.values():
            writer.close()
        few_s, many_s = statistics.median(times[few]), statistics.median(times[many])
        print(f"sync of 1 new record, run of 10 keys        : {few_s:6.2f} s (median of {args.rounds})")
        print(f"sync of 1 new record, run of {args.keys:,} keys  : {many_s:6.2f} s")
        print(f"{args.keys:,} keys / 10 keys                   : {many_s / few_s:5.2f}x   (target <= 3x)")


if __name__ == "__main__":
    main()
