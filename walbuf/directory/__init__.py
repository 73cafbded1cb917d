"""Directory buffers: shards on shared storage, one per writing process, brought together in a hub.

- :mod:`.layout`: the marker, folders and shard files; this host's name
- :mod:`.frames`: the shard file format (frames appended, never rewritten)
- :mod:`.appender`: this process's live shard (appending, rotating, sealing)
- :mod:`.host`: which process appends a shard, and whether it still runs
- :mod:`.shard`: reading a shard's frames, as untrusted input
- :mod:`.view`: the hub's place in each shard, read in one snapshot, and what a shard holds past it
- :mod:`.ingest`: every shard into the hub, each record once, the ranges it cannot read yet kept for later
- :mod:`.sealing`: who seals which shard
- :mod:`.upgrade`: an older walbuf's SQLite shards, taken in once
- :mod:`.mounts`, :mod:`.sync_host`: the buffer's filesystem, and the one host that syncs where locks do not span hosts
- :mod:`.buffer`: the DirectoryBuffer the rest of walbuf uses
"""

from .buffer import DirectoryBuffer

__all__ = ["DirectoryBuffer"]
