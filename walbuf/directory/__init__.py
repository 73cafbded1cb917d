"""Directory buffers: per-host SQLite shards on shared storage, brought together in a hub.

- :mod:`.layout`: the marker, folders and shard files; this host's name
- :mod:`.lease`: which live shard a host's writers share, and sealing it
- :mod:`.shard`: reading a shard (a read-only snapshot)
- :mod:`.ingest`: copying shards into the hub, each record once
- :mod:`.buffer`: the DirectoryBuffer the rest of walbuf uses
"""

from .buffer import Backlog, DirectoryBuffer

__all__ = ["Backlog", "DirectoryBuffer"]
