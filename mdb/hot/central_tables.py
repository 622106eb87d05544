"""The built-in CENTRAL variants of the hot-data tables (created by ``mdb schema apply``).

Global data that belongs to no briefcase (a network-wide total, a CENTRAL event stream) uses
these; an application that wants counters with several named values on CENTRAL declares its
own family with ``counter_tables(central_metadata, "name", values=[...])`` at import time.
"""

from __future__ import annotations

from mdb.hot.tables import counter_tables, event_log_tables, stats_lock_tables
from mdb.system_tables import central_metadata

__all__ = ["CENTRAL_COUNTERS", "CENTRAL_EVENT_LOG", "CENTRAL_STATS_LOCK"]

CENTRAL_COUNTERS = counter_tables(central_metadata, "mdb_counters", ("value",))
CENTRAL_STATS_LOCK = stats_lock_tables(central_metadata, "mdb_stats_lock")
CENTRAL_EVENT_LOG = event_log_tables(central_metadata, "mdb_event_log")
