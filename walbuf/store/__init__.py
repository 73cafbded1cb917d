"""The store: one buffer database (SQLite or PostgreSQL), its schema, and the queries on it.

- :mod:`.schema`: the tables and revisions (migrations in migrations/, installed as walbuf.migrations)
- :mod:`.backend`: what a database kind must provide; :mod:`.sqlite` and
  :mod:`.postgresql` the two kinds
- :mod:`.storage`: an open database and the queries every layer shares
- :mod:`.target`: the W&B run a walbuf run syncs into
"""

from .backend import Access, Durability
from .storage import Storage
from .target import Target

__all__ = ["Access", "Durability", "Storage", "Target"]
