"""The history store: every sample of a profile, kept on disk append-only and crash-safe, read back by time.

Sits between the model and the session: imports agent.model and agent.errors only (no bcc, no /proc).
The byte layout is specified in docs/store-format.md.
"""

from agent.store.reader import SegmentReader, Skipped, SnapshotRef, SnapshotUnavailable, StoredSnapshot, StoreReader
from agent.store.retention import Retention, ThinRule
from agent.store.sample import PeakState, StoreMeta, StoreSample
from agent.store.writer import StoreWriteError, StoreWriter, SyncPolicy

__all__ = [
    "PeakState",
    "Retention",
    "SegmentReader",
    "Skipped",
    "SnapshotRef",
    "SnapshotUnavailable",
    "StoreMeta",
    "StoreReader",
    "StoreSample",
    "StoreWriteError",
    "StoreWriter",
    "StoredSnapshot",
    "SyncPolicy",
    "ThinRule",
]
