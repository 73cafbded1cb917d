"""Sealing: a shard becomes sealed once nothing will be appended to it, and only a process that knows it says so.

A shard (walbuf.directory.appender) is sealed by its own process: an END
frame, then a rename into sealed/. A process that died leaves its shard
live; a sync on the same machine (where it can tell for sure that the
process ended, see walbuf.directory.host) renames it into sealed/
(:func:`seal_ended`), with no END frame. A sync on another machine never
does: it reads the shard as it is, and changes nothing of it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..store.trust import fsync
from .layout import Layout
from .shard import ShardError, ShardGone, first_process


def seal_ended(layout: Layout) -> list[Path]:
    """Seal the live shards whose process ended on this machine (it is sure of that alone); their new paths.

    Such a shard ends at its last whole frame (a frame its process was
    writing as it died is cut off). One that is not a shard walbuf wrote is
    left where it is: ingest reports it.
    """
    sealed = []
    for shard in layout.shards("live"):
        try:
            process = first_process(layout, shard)
        except (ShardGone, ShardError):
            continue
        if process is None or process.running() is not False:
            continue  # it runs, or its machine is another: not this sync's to judge
        owner = layout.own()
        owner.folder(layout.sealed, make=True)
        target = shard.filed(layout.sealed)
        os.replace(shard.path, target)
        sealed.append(target)
    if sealed:
        fsync(layout.sealed, folder=True)
    return sealed
