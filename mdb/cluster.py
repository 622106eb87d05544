"""What features need from the servers of a map, as a typed interface: the seam under the Store.

CENTRAL, GDID generation, fan-out, the hot-data patterns, moves and the fleet tools all work
*through* a cluster: they route with its router, run work in a transaction on one of its
servers, open briefcase sessions, and ask it to refresh when a route turned out stale. They
take a :class:`Cluster`, never the concrete :class:`mdb.store.Store`, so the Store can compose
them (``store.central``, ``store.ids``, ``store.fan_out``) without an import cycle: the Store
sits above the features, the features above this interface (docs/concepts.md, "Architecture").
This is the shape of SQLAlchemy's horizontal_shard, where the session is given its choosers
and the choosers never import the session.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sqlalchemy import Engine
from sqlalchemy.engine import Connection

from mdb.briefcase import BriefcaseType
from mdb.gdid import GDID
from mdb.partition_map import PartitionMap
from mdb.registry import Registry
from mdb.router import Router

if TYPE_CHECKING:
    from mdb.engines import BeginPrelude, EngineRegistry
    from mdb.session import BriefcaseSession

__all__ = ["Cluster"]


class Cluster(Protocol):
    """The servers of one partition map, as the features use them (implemented by :class:`mdb.store.Store`)."""

    @property
    def map(self) -> PartitionMap:
        """The map routed with now (no I/O)."""
        ...

    @property
    def router(self) -> Router:
        """The router of :attr:`map` with the relocation directory (loaded on first use)."""
        ...

    @property
    def map_path(self) -> Path | None:
        """The map file re-read on refresh, if there is one."""
        ...

    @property
    def engines(self) -> EngineRegistry:
        """The SQL servers' engines (connection budget, pools)."""
        ...

    @property
    def registry(self) -> Registry:
        """The declarations this cluster serves (types, CENTRAL indexes, event logs)."""
        ...

    @property
    def types(self) -> list[type[BriefcaseType]]:
        """Every briefcase type this cluster serves."""
        ...

    def refresh(self) -> None:
        """Re-read the map (file, or the newest applied in CENTRAL) and the relocation directory."""
        ...

    def types_of(self, area: str) -> list[type[BriefcaseType]]:
        """The briefcase types of ``area`` this cluster serves."""
        ...

    def engine(self, server: str, readonly: bool = False) -> Engine: ...

    def connect(self, server: str, readonly: bool = False) -> Connection:
        """A pooled connection to a SQL server, driver errors turned into mdb errors."""
        ...

    def transaction(self, server: str, readonly: bool = False, prelude: BeginPrelude | None = None) -> AbstractContextManager[Connection]:
        """A connection in one transaction on ``server``: commit on success, rollback on error."""
        ...

    def begin(self, server: str, readonly: bool = False) -> Connection:
        """A connection already in a transaction; the caller ends it and closes it."""
        ...

    def briefcase(
        self, btype: type[BriefcaseType], gdid: GDID | str, *, readonly: bool = False, exclusive: bool = False
    ) -> AbstractContextManager[BriefcaseSession]:
        """A session on the briefcase's shard in one transaction, after the ownership check."""
        ...
