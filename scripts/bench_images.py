"""The disk that logged images take: a walbuf buffer against wandb's offline run directory.

    python scripts/bench_images.py [--images 1000] [--size 64]

Logs the same N images of SIZExSIZE RGB, one per step, three ways: into a
SQLite buffer, into a directory buffer (walbuf.Image: PNG kept inside the
record), and with offline wandb (wandb.Image: one PNG file per image in the
run directory). Two kinds of image: noise (PNG cannot compress it) and a
smooth picture (PNG compresses it well). Prints, for each, the bytes and
disk blocks and files after the writer closed, per 1,000 images, and the time of
one log() against wandb.log() as a ratio (same process, same run of the
script).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("WANDB_SILENT", "true")


def images(kind: str, n: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    if kind == "noise":
        return [rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8) for _ in range(n)]
    y, x = np.mgrid[0:size, 0:size] / size
    out = []
    for i in range(n):
        phase = i / n * 2 * np.pi
        picture = np.stack([np.sin(6 * x + phase), np.cos(5 * y - phase), np.sin(4 * (x + y) + phase)], axis=-1)
        out.append(((picture + 1) * 127.5).astype(np.uint8))
    return out


def disk(path: Path) -> tuple[int, int, int]:
    """Bytes of content, bytes of disk blocks taken and number of files under ``path`` (a file counts itself).

    Blocks are what a quota counts: a small file takes a whole block (4 KiB on most file systems).
    """
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    stats = [p.stat() for p in files]
    return sum(s.st_size for s in stats), sum(s.st_blocks * 512 for s in stats), len(files)


def log_walbuf(location: str, arrays: list[np.ndarray]) -> float:
    import walbuf

    start = time.perf_counter()
    with walbuf.Writer(location, writer="w", run="images") as w:
        for step, array in enumerate(arrays):
            w.log({"sample": walbuf.Image(array)}, step=step)
    return time.perf_counter() - start


def log_wandb(directory: str, arrays: list[np.ndarray]) -> tuple[float, Path]:
    import wandb

    run = wandb.init(
        mode="offline", dir=directory, project="bench", settings=wandb.Settings(console="off", x_disable_stats=True)
    )
    start = time.perf_counter()
    for array in arrays:
        run.log({"sample": wandb.Image(array)})
    elapsed = time.perf_counter() - start
    run.finish()
    return elapsed, Path(run.dir).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    per = 1000 / args.images
    print(f"{args.images} images of {args.size}x{args.size} RGB; figures per 1,000 images")
    print(f"{'kind':7} {'where':28} {'MB':>8} {'MB disk':>8} {'files':>7} {'log() / wandb.log()':>20}")
    for kind in ("noise", "smooth"):
        arrays = images(kind, args.images, args.size)
        with tempfile.TemporaryDirectory() as tmp:
            wandb_time, run_dir = log_wandb(tmp + "/wandb", arrays)
            sqlite_time = log_walbuf(tmp + "/buffer.db", arrays)
            directory_time = log_walbuf(tmp + "/shards/", arrays)
            rows = [
                ("walbuf, SQLite buffer", disk(Path(tmp, "buffer.db")), sqlite_time),
                ("walbuf, directory buffer", disk(Path(tmp, "shards")), directory_time),
                ("wandb offline run directory", disk(run_dir), wandb_time),
            ]
            media = disk(run_dir / "files" / "media")
            for where, (size, blocks, count), elapsed in rows:
                print(
                    f"{kind:7} {where:28} {size * per / 1e6:8.2f} {blocks * per / 1e6:8.2f} {count * per:7.0f}"
                    f" {elapsed / wandb_time:19.2f}x"
                )
            print(
                f"{kind:7} {'  of which media/ PNG files':28} {media[0] * per / 1e6:8.2f} {media[1] * per / 1e6:8.2f}"
                f" {media[2] * per:7.0f}"
            )


if __name__ == "__main__":
    main()
