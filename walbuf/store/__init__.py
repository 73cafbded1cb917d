"""The store: one buffer database (SQLite or PostgreSQL), its schema, and the queries on it.

- :mod:`.schema`: the tables and revisions (migrations in migrations/, installed as walbuf.migrations)
- :mod:`.backend`: what a database kind must provide; :mod:`.sqlite` and
  :mod:`.postgresql` the two kinds
- :mod:`.storage`: an open database and the queries every layer shares
- :mod:`.target`: the W&B run a walbuf run syncs into
- :mod:`.claims`: which step axis each W&B key of a run is plotted against
- :mod:`.trust`: a buffer's owner, and which of its files walbuf acts on;
  :mod:`.flock`: kernel file locks on the lock files it trusts
- :mod:`.machine`: this machine, its boot and PID namespace, and whether a
  process of it runs
- :mod:`.space`: a full disk told from damage, and room kept for a sync
- :mod:`.source`: what every buffer kind hands the sync and status
  (SyncSource, Backlog)
"""

from .backend import Access, Durability
from .storage import Storage
from .target import Target

__all__ = ["Access", "Durability", "Storage", "Target"]
