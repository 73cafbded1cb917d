"""The writer of test_crash_points.py: a small training job's logging, each call said once it returned.

Usage: crash_point_writer.py BUFFER LIVES RECORDS [PREFIX [stay]]

Each life opens writer "train" (project "crash", run "crash") and writer
"eval" (step axis "epoch"), logs RECORDS records to train and one to eval
every tenth, makes everything durable (flush), closes eval, sets a summary
value and closes train. The first life also sets the run's config. So a
directory buffer's process seals a shard at the end of each life (its last
writer closes) and starts a new one at the next: no timing is involved.

After each call returned it writes one line to stdout, in one write()
(print() would make several, each a crash point of its own): ``config``,
``train STEP``, ``eval STEP`` (writer ids), ``flushed LIFE``, ``summary LIFE``,
``closed LIFE``. A record whose line was written is an acknowledged one.
Each record holds ``{"seq": STEP, ...}``, so that a reader can tell a record
that went to the wrong step.

PREFIX goes before the writer ids and the config key (``PREFIXtrain``...),
so that several of these processes can fill one buffer. With ``stay`` the
last life does not close train: it says ``staying`` and waits until its
stdin closes (or it is killed), then closes it and says ``closed LIFE``.
"""

import os
import sys

import walbuf

RUN = "crash"


def said(line: str) -> None:
    os.write(1, f"{line}\n".encode())


buffer, lives, records = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prefix = sys.argv[4] if len(sys.argv) > 4 else ""
stay = sys.argv[5:] == ["stay"]
for life in range(lives):
    train = walbuf.Writer(buffer, writer=f"{prefix}train", run=RUN, project="crash")
    evaluation = walbuf.Writer(buffer, writer=f"{prefix}eval", run=RUN, step_axis="epoch")
    if life == 0:
        train.config({f"{prefix}lr": 0.001, f"{prefix}layers": [64, 64]})
        said("config")
    step = -1 if train.last_step is None else train.last_step
    epoch = -1 if evaluation.last_step is None else evaluation.last_step
    for i in range(records):
        step = train.log({"seq": step + 1, "loss": 1.0 / (step + 2), "lr": 0.001})
        said(f"{prefix}train {step}")
        if i % 10 == 0:
            epoch = evaluation.log({"seq": epoch + 1, "accuracy": i / records})
            said(f"{prefix}eval {epoch}")
    train.flush()
    said(f"flushed {life}")
    evaluation.close()
    train.summary({f"{prefix}best_loss_{life}": 1.0 / (step + 2)})
    said(f"summary {life}")
    if stay and life == lives - 1:
        said("staying")
        sys.stdin.read()
    train.close()
    said(f"closed {life}")
