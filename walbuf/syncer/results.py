"""What a sync did: per run, and for the whole buffer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ..store import Target

SyncMode = Literal["online", "offline"]
"""online: upload to W&B. offline: write a wandb offline run directory for `wandb sync`."""

SYNC_MODES: tuple[SyncMode, ...] = ("online", "offline")


@dataclass(frozen=True)
class ConfigChange:
    """A run config key set again with another value: the later one is what W&B gets."""

    key: str
    old_writer: str
    old_value: object
    new_writer: str
    new_value: object


@dataclass(frozen=True)
class Quarantined:
    """A record W&B would refuse for good: never sent, kept in the buffer with the reason."""

    writer: str
    step: int
    reason: str


@dataclass(frozen=True)
class RefusedSetting:
    """A config or summary key W&B would refuse for good: left out of what the sync sends."""

    kind: str  # "config" or "summary"
    key: str
    writer: str
    reason: str


@dataclass(frozen=True)
class RunSync:
    """What one sync of one run did (or, in a dry run or before its upload, will do)."""

    run: str
    target: Target
    mode: SyncMode
    records: int = 0
    per_writer: Mapping[str, int] = field(default_factory=dict)
    # Records a cut-off earlier upload may already have delivered: sent again, maybe twice.
    possibly_duplicated: int = 0
    offline_dir: str | None = None
    # Config keys whose value a later Writer.config() replaced, since the last sync.
    config_changes: tuple[ConfigChange, ...] = ()
    # Records quarantined by this sync, and config or summary keys it left out (set since the last sync).
    quarantined: tuple[Quarantined, ...] = ()
    refused_settings: tuple[RefusedSetting, ...] = ()
    # The bounds ended the upload with records of the run still pending.
    cut_short: bool = False
    # The exit code this sync finished the W&B run with (its job is done); None: left running.
    finished: int | None = None
    # With finished 1: the writers that failed or died without closing.
    failed_writers: tuple[str, ...] = ()

    @property
    def needs_a_person(self) -> bool:
        """Whether W&B refused part of what the run holds (see quarantined and refused_settings)."""
        return bool(self.quarantined or self.refused_settings)


@dataclass(frozen=True)
class SyncResult:
    """What a sync of a buffer did, run by run. ``records`` is the total sent."""

    runs: tuple[RunSync, ...]
    dry_run: bool = False
    # A dry run of a directory buffer: records in shards not yet copied into
    # the hub, which a real sync copies in first (not counted in ``records``),
    # and other hosts' live shards, which it cannot read yet.
    not_in_hub: int = 0
    unreadable_shards: int = 0
    # The bounds (max_records, max_seconds) ended the sync with records still pending.
    stopped_early: bool = False
    # Of a directory buffer: what the sync did not open or take in whole, a
    # message each: files walbuf does not trust (another account's, a
    # symbolic link, a name walbuf does not give there), a shard that holds
    # what walbuf never writes or is damaged, an older walbuf's shard.
    refused: tuple[str, ...] = ()

    @property
    def records(self) -> int:
        return sum(r.records for r in self.runs)

    @property
    def quarantined(self) -> int:
        """Records quarantined by this sync, over all runs."""
        return sum(len(r.quarantined) for r in self.runs)

    @property
    def needs_a_person(self) -> bool:
        """Whether part of the buffer was not sent for good (records, shards, settings) or was refused."""
        return bool(self.refused) or any(r.needs_a_person for r in self.runs)
