"""mdb: an MDB-style router that spreads briefcases of relational data over many servers."""

from typing import TYPE_CHECKING

from mdb.briefcase import BriefcaseType
from mdb.central import Central, CentralIndex
from mdb.engines import EngineRegistry
from mdb.errors import (
    BriefcaseMovingError,
    CrossBriefcaseError,
    DuplicateKeyError,
    DuplicateRowError,
    GDIDError,
    MapEditError,
    MapError,
    MdbError,
    MigrationError,
    QueryError,
    RetryableError,
    RoutingError,
    SchemaError,
    ServerUnavailableError,
    StaleRouteError,
    StatsError,
)
from mdb.fanout import FanOutResult, ShardFailure
from mdb.gdid import GDID
from mdb.idgen import GdidGenerator
from mdb.maps.apply import ApplyReport, apply_map
from mdb.maps.diff import MapDiff, diff_maps
from mdb.maps.high_water import high_water_marks
from mdb.partition_map import PartitionMap, load_map, parse_map
from mdb.router import CentralPlacement, Placement, Router, ShardLayout
from mdb.session import BriefcaseSession
from mdb.sqltypes import GDIDType
from mdb.store import Store
from mdb.repository import Repository
from mdb.urls import mask_url

if TYPE_CHECKING:
    from mdb.aio import AsyncStore


def __getattr__(name: str) -> object:
    """``mdb.AsyncStore``, imported on first use: SQLAlchemy's asyncio extension (greenlet) costs
    ~50 ms at import, which every ``mdb`` command and sync application would otherwise pay."""
    if name == "AsyncStore":
        from mdb.aio import AsyncStore

        return AsyncStore
    raise AttributeError(f"module 'mdb' has no attribute {name!r}")

__all__ = [
    "ApplyReport",
    "AsyncStore",
    "MapDiff",
    "apply_map",
    "diff_maps",
    "high_water_marks",
    "BriefcaseMovingError",
    "BriefcaseSession",
    "BriefcaseType",
    "Central",
    "CentralIndex",
    "CentralPlacement",
    "CrossBriefcaseError",
    "DuplicateKeyError",
    "DuplicateRowError",
    "EngineRegistry",
    "FanOutResult",
    "GDID",
    "GDIDError",
    "GDIDType",
    "GdidGenerator",
    "MapEditError",
    "MapError",
    "MdbError",
    "MigrationError",
    "PartitionMap",
    "Placement",
    "QueryError",
    "Repository",
    "RetryableError",
    "Router",
    "RoutingError",
    "SchemaError",
    "ServerUnavailableError",
    "ShardFailure",
    "ShardLayout",
    "StaleRouteError",
    "StatsError",
    "Store",
    "load_map",
    "mask_url",
    "parse_map",
]
