"""Hot-data patterns: logically sharded counters, an idempotent stats lock, event log + snapshots.

Each works on CENTRAL (global data, :func:`central` places) and inside a briefcase (per-entity
data that moves with it: declare the tables with the ``*_models`` factories and list the
classes in the BriefcaseType's children). See docs/hot-data.md.
"""

from mdb.hot.counters import Counters
from mdb.hot.event_log import EventLog, Fold, SnapshotResult, StreamState, SumFold, registered_logs, run_snapshots
from mdb.hot.scope import Scope, central
from mdb.hot.stats_lock import StatsLock
from mdb.hot.tables import (
    CounterTables,
    EventLogTables,
    StatsLockTables,
    counter_models,
    counter_tables,
    derived_gdid,
    event_log_models,
    event_log_tables,
    stats_lock_models,
    stats_lock_tables,
)

__all__ = [
    "CounterTables",
    "Counters",
    "EventLog",
    "EventLogTables",
    "Fold",
    "Scope",
    "SnapshotResult",
    "StatsLock",
    "StatsLockTables",
    "StreamState",
    "SumFold",
    "central",
    "counter_models",
    "counter_tables",
    "derived_gdid",
    "event_log_models",
    "event_log_tables",
    "registered_logs",
    "run_snapshots",
    "stats_lock_models",
    "stats_lock_tables",
]
