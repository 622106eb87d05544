"""mdb: an MDB-style router that spreads briefcases of relational data over many servers.

The application API is the names below (docs/reference.md); operator tools (map apply, moves,
migrations, fleet repair) are in :mod:`mdb.ops`. Every name is imported on first use (module
``__getattr__``, as SQLAlchemy and pydantic do), so ``import mdb`` costs almost nothing and
loads no optional plug-in (MongoDB: :mod:`mdb.mongo`; asyncio: :mod:`mdb.aio`). Other modules
are internal: their ``__all__`` says what other mdb modules use, not what is promised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mdb._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports each on first use
    from mdb.aio import AsyncStore
    from mdb.briefcase import BriefcaseType
    from mdb.budget import ConnectionBudget
    from mdb.central import Central, CentralIndex
    from mdb.errors import (
        AuthenticationError, BriefcaseMovingError, CapacityError, CrossBriefcaseError, DuplicateKeyError,
        DuplicateRowError, GDIDError, MapError, MdbError, QueryError, RetryableError, RoutingError, SchemaError,
        ServerUnavailableError, StaleRouteError, StatsError, TransactionConflictError,
    )
    from mdb.fanout import FanOutResult, ShardFailure
    from mdb.gdid import GDID
    from mdb.idgen import GdidGenerator
    from mdb.partition_map import PartitionMap, load_map, parse_map
    from mdb.repository import Repository
    from mdb.router import Placement, Router
    from mdb.session import BriefcaseSession
    from mdb.sqltypes import GDIDType
    from mdb.store import Store
    from mdb.urls import mask_url

_ERRORS = (
    "AuthenticationError", "BriefcaseMovingError", "CapacityError", "CrossBriefcaseError", "DuplicateKeyError",
    "DuplicateRowError", "GDIDError", "MapError", "MdbError", "QueryError", "RetryableError", "RoutingError",
    "SchemaError", "ServerUnavailableError", "StaleRouteError", "StatsError", "TransactionConflictError",
)

_WHERE: dict[str, str] = {
    "AsyncStore": "mdb.aio",
    "BriefcaseSession": "mdb.session",
    "BriefcaseType": "mdb.briefcase",
    "Central": "mdb.central",
    "CentralIndex": "mdb.central",
    "ConnectionBudget": "mdb.budget",
    "FanOutResult": "mdb.fanout",
    "GDID": "mdb.gdid",
    "GDIDType": "mdb.sqltypes",
    "GdidGenerator": "mdb.idgen",
    "PartitionMap": "mdb.partition_map",
    "Placement": "mdb.router",
    "Registry": "mdb.registry",
    "Repository": "mdb.repository",
    "Router": "mdb.router",
    "ShardFailure": "mdb.fanout",
    "Store": "mdb.store",
    "load_map": "mdb.partition_map",
    "mask_url": "mdb.urls",
    "parse_map": "mdb.partition_map",
    **dict.fromkeys(_ERRORS, "mdb.errors"),
}
"""Each public name and the module that defines it."""

__all__ = [
    "AsyncStore",
    "AuthenticationError",
    "BriefcaseMovingError",
    "BriefcaseSession",
    "BriefcaseType",
    "CapacityError",
    "Central",
    "CentralIndex",
    "ConnectionBudget",
    "CrossBriefcaseError",
    "DuplicateKeyError",
    "DuplicateRowError",
    "FanOutResult",
    "GDID",
    "GDIDError",
    "GDIDType",
    "GdidGenerator",
    "MapError",
    "MdbError",
    "PartitionMap",
    "Placement",
    "Registry",
    "QueryError",
    "Repository",
    "RetryableError",
    "Router",
    "RoutingError",
    "SchemaError",
    "ServerUnavailableError",
    "ShardFailure",
    "StaleRouteError",
    "StatsError",
    "Store",
    "TransactionConflictError",
    "load_map",
    "mask_url",
    "parse_map",
]


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
