"""CENTRAL: string-key indexes (key -> GDID), their cache, atomic entity creation, check/repair.

Application code reaches it as ``store.central`` (a :class:`Central`); indexes are declared as
:class:`CentralIndex` subclasses. See docs/central.md.
"""

from mdb.central.cache import CacheStats, CentralCache
from mdb.central.indexes import (
    STATE_LIVE,
    STATE_PENDING,
    CentralIndex,
    casefold,
    central_index,
    exact,
    index_by_name,
    nfkc_strip_casefold,
    registered_indexes,
    strip,
    strip_casefold,
)
from mdb.central.service import Central

__all__ = [
    "STATE_LIVE",
    "STATE_PENDING",
    "CacheStats",
    "Central",
    "CentralCache",
    "CentralIndex",
    "casefold",
    "central_index",
    "exact",
    "index_by_name",
    "nfkc_strip_casefold",
    "registered_indexes",
    "strip",
    "strip_casefold",
]
