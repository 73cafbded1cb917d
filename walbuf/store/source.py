"""What every buffer kind hands the layers above (sync, status): neutral types no kind owns.

A kind (walbuf.buffer.DatabaseBuffer, walbuf.directory.DirectoryBuffer, a
third one) returns these from ``open_for_sync``, ``backlog`` and
``hold_shard``; the sync, status and the decorator use them without knowing
the kind.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from .storage import Storage


@dataclass(frozen=True)
class SyncSource:
    """The database a sync uploads from, open, and what bringing it together found."""

    storage: Storage
    # What the sync did not open or take in whole, a message each: files walbuf
    # does not trust or does not name so, damaged or refused shards.
    refused: tuple[str, ...] = ()
    # The sync's stop condition held before every part was taken in.
    stopped: bool = False


@dataclass(frozen=True)
class Backlog:
    """A part of a buffer (a directory buffer's shard) whose records the database a sync uploads from lacks."""

    name: str  # stable across the part's life (a shard's HOST.GEN)
    host: str  # the host whose processes wrote it
    live: bool  # still written to (else sealed: complete)
    created_at: float  # seconds since the epoch
    # Records the next sync on this host copies in; None: a part this host may
    # not read (an older walbuf's live shard of another host), or one refused.
    not_in_hub: int | None
    # Why the next sync sets the part aside or reads it only up to a point
    # (damaged, or holding what walbuf never writes); None if not.
    refused: str | None = None


@dataclass(frozen=True)
class Backlogs:
    """The parts a store lacks records of, counted against one read of the store; iterate for them.

    ``store_top`` is the store's newest record id in that read (None where
    it holds every record itself): a record the store takes in later has a
    larger id, and is counted in its part, so that counting the store's
    records up to it counts each record once.
    """

    parts: tuple[Backlog, ...] = ()
    store_top: int | None = None

    def __iter__(self) -> Iterator[Backlog]:
        return iter(self.parts)


class Hold(Protocol):
    """A hold on what this process writes into (a directory buffer's live shard), kept until released."""

    def release(self) -> None:
        """Let go (once; again does nothing)."""

    def abandon(self) -> None:
        """In a forked child: forget the parent's hold without letting go of it."""
