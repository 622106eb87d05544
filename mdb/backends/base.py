"""The backend interface: what a feature needs from one server of a given kind.

Every feature that touches a server's own data (ownership and briefcase state, layout stamps,
the relocation directory on CENTRAL, fan-out) used to be written twice, once for SQL and once
for MongoDB, and chosen by scattered URL tests. Here it is one interface with one
implementation per server kind (:mod:`mdb.backends.sql`, :mod:`mdb.backends.mongo`), picked by
the server's kind (``PartitionMap.kind_of``) through the registry in :mod:`mdb.backends`: adding
a server kind means one new module, not a branch in every feature.

This module sits below the Store and the features (``mdb.cluster`` included), so it cannot name
:class:`mdb.cluster.Cluster`; :class:`Servers` is the part of it backends use, and every Cluster
satisfies it structurally.
"""

from __future__ import annotations

import time

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from sqlalchemy import Table
from sqlalchemy.engine import Connection

from mdb.errors import MdbError, RetryableError
from mdb.gdid import GDID
from mdb.partition_map import PartitionMap
from mdb.retry import RoutedOpen
from mdb.router import Placement, Reach, Router, ShardLayout

__all__ = [
    "AreaData", "AreaScan", "Backend", "BriefcaseSize", "BriefcaseStateRow", "CollectionSpec", "DocumentServers", "HasDocuments", "Holding", "IndexSpec", "SchemaOutcome", "ServerSchema",
    "Servers", "documents_of", "open_routed",
]


class Servers(Protocol):
    """What a backend needs of a cluster (a structural subset of :class:`mdb.cluster.Cluster`)."""

    @property
    def map(self) -> PartitionMap:
        """The map routed with now: which servers exist and of which kind."""
        ...

    @property
    def router(self) -> Router:
        """The router of the map routed with now (the routed-open loop places sessions with it; it
        does not read the relocation directory, :mod:`mdb.retry`)."""
        ...

    def refresh(self) -> None:
        """Re-read the map after a stale route (the relocation directory is read again only when asked for)."""
        ...

    def transaction(self, server: str, readonly: bool = False) -> AbstractContextManager[Connection]:
        """A SQL connection in one transaction on ``server`` (SQL backend only)."""
        ...


class DocumentServers(Protocol):
    """The MongoDB clients of a cluster (implemented by :class:`mdb.mongo.store.MongoStore`).

    Kept here, not read from the Store's private attributes, so the MongoDB backend depends on
    three methods instead of the whole document layer above it.
    """

    def database(self, server: str, readonly: bool = False) -> Any:
        """The mdb database on ``server`` (a pymongo ``Database``)."""
        ...

    def transactions(self, server: str) -> bool:
        """Whether ``server`` runs multi-document transactions (replica set, mongos)."""
        ...

    def translate(self, server: str, exc: BaseException) -> MdbError | None:
        """A driver error as an mdb error (secrets masked), None when it is not a driver error."""
        ...


@runtime_checkable
class HasDocuments(Protocol):
    """A cluster that serves MongoDB servers too (the Store does, through ``store.mongo``)."""

    @property
    def mongo(self) -> DocumentServers:
        """The cluster's MongoDB clients, created on first use."""
        ...


@dataclass(frozen=True)
class IndexSpec:
    """A secondary index of a document collection: keys (field, direction), name, uniqueness, options."""

    keys: Sequence[tuple[str, Any]]
    name: str
    unique: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CollectionSpec:
    """A document collection a server must hold, with its indexes."""

    name: str
    indexes: Sequence[IndexSpec] = ()


@dataclass
class ServerSchema:
    """What one server must hold, computed from the map and the declared types by ``mdb.schema``.

    Each backend reads the part of its kind: tables (SQL) or collections (MongoDB); the layouts
    are stamped where the server has none yet.
    """

    layouts: list[ShardLayout]
    map_version: int
    tables: list[Table] = field(default_factory=list)
    known_tables: set[str] = field(default_factory=set)
    """Every table mdb knows of, so a table of another area is not reported as extra (SQL)."""
    collections: list[CollectionSpec] = field(default_factory=list)


@dataclass
class SchemaOutcome:
    """What applying a :class:`ServerSchema` did on one server, and how it still differs."""

    created: list[str] = field(default_factory=list)
    stamped: list[str] = field(default_factory=list)
    """Areas whose layout stamp this run wrote."""
    kept: list[str] = field(default_factory=list)
    """Areas already stamped with the same layout (nothing written)."""
    problems: list[str] = field(default_factory=list)
    differences: list[Any] = field(default_factory=list)
    """How the server's tables differ from the models (SQL; :class:`mdb.schema_diff.Difference`)."""

    def record_stamp(self, area: str, problem: str | None, already: set[str]) -> None:
        """File one area's stamp result: a refusal, a stamp kept, or a stamp written."""
        if problem:
            self.problems.append(problem)
        else:
            (self.kept if area in already else self.stamped).append(area)


@dataclass(frozen=True)
class AreaData:
    """Where an area's briefcases live on a server, as the fleet tools scan them.

    Computed from the declared types by the caller (the backends sit below the types): SQL
    tables with their briefcase key column, document collections with their key field. Each
    backend reads the part of its kind.
    """

    area: str
    tables: Sequence[tuple[Table, str]] = ()
    """(table, name of its GDID key column), SQL servers."""
    collections: Sequence[tuple[str, str]] = ()
    """(collection name, name of its GDID key field), MongoDB servers."""


@dataclass(frozen=True)
class BriefcaseSize:
    """One briefcase's data on one server: rows (documents), bytes, which tables (collections) hold it."""

    gdid: GDID
    rows: int
    bytes: int
    tables: tuple[str, ...]
    """Tables (collections) holding at least one row (document) of the briefcase on this server."""


@dataclass(frozen=True)
class BriefcaseStateRow:
    """One briefcase state record on a server (``mdb_briefcase_state``: a fence, incoming, resident, frozen)."""

    gdid: GDID
    state: str
    peer: str | None
    move_id: str | None
    changed_at: datetime | None = None
    """When the state was written (how long a partition has been frozen); None where the server does not say."""


@dataclass(frozen=True)
class Holding:
    """What one server holds of one briefcase, as ``mdb where`` shows it: rows (documents) in
    those of the area's tables (collections) that exist there, and its state record, if any."""

    rows: int
    state: BriefcaseStateRow | None


class AreaScan(ABC):
    """One server's briefcases of one area, read for ``mdb balance``/``fsck``/``rebalance``.

    Every iterator streams (a server-side cursor, batches): a shard's keys are never all in
    memory. Each call is its own read (transaction where the kind has them), so a scan is not a
    snapshot of the server; the fleet tools re-check what they act on.
    """

    @abstractmethod
    def sizes(self) -> Iterator[BriefcaseSize]:
        """Every briefcase with data on this server, in GDID order, with its rows and bytes.

        Bytes are the data's own size, what a move of the briefcase carries (SQL: row sizes;
        MongoDB: BSON document sizes), not the storage engine's pages.
        """

    @abstractmethod
    def keys(self) -> Iterator[GDID]:
        """Every briefcase with data on this server, in GDID order (cheaper than :meth:`sizes`)."""

    @abstractmethod
    def rows_of(self, gdid: GDID) -> int:
        """Rows (documents) of one briefcase on this server."""

    @abstractmethod
    def storage_bytes(self) -> int | None:
        """What the area's tables (collections) occupy on disk incl. indexes; None when the server cannot say."""

    @abstractmethod
    def states(self) -> Iterator[BriefcaseStateRow]:
        """The area's briefcase state records on this server, in GDID order."""


class Backend(ABC):
    """The server-side half of every feature, for the servers of one kind.

    A backend holds no state: each method is given the cluster and the server, so one instance
    per kind serves every Store of the process.
    """

    kind: ClassVar[str]
    """The server kind it implements (``mdb.urls.SQL``, ``mdb.urls.MONGO``, ...)."""

    # -- capabilities: a feature asks whether a server's backend has one (``backend_of(pmap, s).x``,
    # ``servers_where``), never which kind the server is; a new kind sets the ones it implements.

    follows_histories: ClassVar[bool] = False
    """Its servers follow each area's Alembic history (``mdb migrate``): a revision can be
    autogenerated against one, and one built from the models is stamped at head."""
    holds_documents: ClassVar[bool] = False
    """Its servers hold document briefcases, reached through the cluster's document side (:func:`documents_of`)."""
    declares_indexes: ClassVar[bool] = False
    """Its areas have no history: ``mdb migrate up`` takes them to the indexes their types declare
    (:mod:`mdb.migrations.documents`)."""
    keeps_records: ClassVar[bool] = False
    """A CENTRAL of this kind keeps mdb's records in tables: the map history, the server
    identities, the migration ledger (elsewhere there are none of them)."""
    has_identity: ClassVar[bool] = False
    """Its servers carry an mdb identity (written by ``schema apply``, checked by ``map apply``)."""
    checks_drift: ClassVar[bool] = False
    """Its tables can be compared column by column with the models (``mdb schema check``)."""
    rechecks_shrink: ClassVar[bool] = False
    """A partition end may shrink: the stored GDIDs are re-checked under a lock that holds writers off."""
    pools_connections: ClassVar[bool] = False
    """Its servers are reached through pooled engines, which ``warm_up`` opens before the first request."""
    batches_cutovers: ClassVar[bool] = False
    """A reshard moves its briefcases in batches, one cutover for many (``mdb.moves.batch``);
    elsewhere one move at a time."""
    replicas_on_engines: ClassVar[bool] = False
    """A ``replica:`` URL of its servers is one of the cluster's SQL engines, whose replay lag a
    reshard's throttle reads (where its dialect streams replicas at all)."""
    takes_lease_fences: ClassVar[bool] = False
    """Its transactions carry a move driver's lease check (``mdb_lease_fences``, DESIGN.md invariant 7):
    a driver's writes there commit only while its lease epoch is current (elsewhere the lease alone)."""

    @abstractmethod
    def stamp_layout(
        self, cluster: Servers, server: str, layout: ShardLayout, map_version: int, *, replace: bool
    ) -> str | None:
        """Write ``server``'s layout stamp of ``layout.area``; a problem text when refused.

        Without ``replace`` a different existing stamp is refused (a layout change is
        ``mdb map apply``'s job, edit safety); with it the stamp is overwritten.
        """

    @abstractmethod
    def load_relocations(self, cluster: Servers, server: str) -> dict[tuple[str, GDID], str]:
        """The relocation directory entries kept on the CENTRAL server ``server``."""

    @abstractmethod
    def relocation_of(self, cluster: Servers, server: str, area: str, gdid: GDID) -> str | None:
        """The directory entry of ``area``/``gdid`` on CENTRAL ``server`` (None: no entry): one key read."""

    @abstractmethod
    def relocation_reach(self, cluster: Servers, server: str) -> dict[tuple[str, str], Reach]:
        """What the directory on CENTRAL ``server`` sends where, per (area, target server), without
        holding its entries: what fan-out and the fleet tools need to know which servers to ask."""

    @abstractmethod
    def set_relocations(self, cluster: Servers, server: str, area: str, targets: Mapping[GDID, str | None]) -> None:
        """Point each ``area``/gdid of ``targets`` at its server in the directory on CENTRAL ``server`` (None clears it).

        One unit of work for them all: a batched cutover records its briefcases together.
        """

    @abstractmethod
    def apply_schema(self, cluster: Servers, server: str, schema: ServerSchema) -> SchemaOutcome:
        """Create what ``server`` is missing of ``schema`` (idempotent), stamp new layouts, report drift.

        A stamp that differs from the map is a problem, never overwritten (``mdb map apply``).
        """

    @abstractmethod
    def scan(self, cluster: Servers, server: str, data: AreaData) -> AreaScan:
        """Read access to ``data``'s briefcases on ``server`` for the fleet tools (balance, fsck, rebalance)."""

    @abstractmethod
    def holds_area(self, cluster: Servers, server: str, data: AreaData) -> bool:
        """Whether ``server`` has any table (collection) of ``data`` (one catalog read); a server
        whose kind ``data`` has nothing of holds none of the area."""

    @abstractmethod
    def holding(self, cluster: Servers, server: str, data: AreaData, gdid: GDID) -> Holding:
        """What ``server`` holds of briefcase ``gdid`` of ``data`` (one read; a server without the
        area's tables holds no rows of it): ``mdb where`` asks every server of the kind, so an
        operator sees a copy or a state record that routing would not lead to."""

    @abstractmethod
    def translate(self, cluster: Servers, server: str, exc: Exception) -> MdbError | None:
        """``exc`` raised by work on ``server`` as an mdb error, or None when it is not the server's.

        The fan-out gather uses it to tell a failed shard (recorded with ``allow_partial``) from
        a bug (always raised).
        """

    # -- resharding
    # A reshard (mdb.moves.reshard) and the map apply it ends with reach a server's partition
    # freeze, its 'resident' records and its layout stamps through these, whatever its kind.

    @abstractmethod
    def freeze_partition(
        self, cluster: Servers, server: str, area: str, start: GDID, reshard_id: str, *, lock_wait: float
    ) -> None:
        """Turn away new write sessions of partition ``start`` on ``server`` (the freeze marker); idempotent.

        Waits for the write sessions already inside where the kind has a lock they hold.
        """

    @abstractmethod
    def unfreeze_partition(self, cluster: Servers, server: str, area: str, start: GDID) -> int:
        """Remove the freeze marker of partition ``start`` on ``server``; the number of markers removed."""

    @abstractmethod
    def mark_applying(self, cluster: Servers, server: str, area: str, start: GDID, mark: str) -> bool:
        """Put a map apply's marker (:func:`mdb.ownership.applying_mark`) on partition ``start`` of ``area``
        unless a marker is there already (a reshard's freeze); True when this wrote it."""

    @abstractmethod
    def clear_applying(self, cluster: Servers, server: str) -> int:
        """Remove every map apply's marker on ``server`` (each area); how many."""

    @abstractmethod
    def frozen_by(self, cluster: Servers, server: str, area: str, start: GDID) -> str | None:
        """The reshard id whose freeze of partition ``start`` is on ``server``, if any."""

    @abstractmethod
    def drop_residents(self, cluster: Servers, server: str, area: str, redundant: Callable[[GDID], bool]) -> int:
        """Delete the 'resident' records of ``area`` on ``server`` whose GDID ``redundant`` accepts; how many."""

    @abstractmethod
    def read_layouts(self, cluster: Servers, server: str) -> dict[str, ShardLayout]:
        """Every layout stamp on ``server``, by area (none when it has no stamp record yet)."""

    @abstractmethod
    def replace_layout(
        self, cluster: Servers, server: str, area: str, layout: ShardLayout | None, map_version: int, *, lock_timeout: float
    ) -> None:
        """Overwrite (or with None delete) ``server``'s stamp of ``area``: a map apply's step.

        Where the kind has a lock that every session's ownership check takes, the write waits
        for the sessions in flight (up to ``lock_timeout`` seconds) and holds off new ones.
        """


def documents_of(cluster: Servers) -> DocumentServers:
    """The MongoDB clients of ``cluster``; a cluster without them cannot reach a MongoDB server."""
    if not isinstance(cluster, HasDocuments):
        raise TypeError(f"{type(cluster).__name__} serves no MongoDB servers (it has no document clients)")
    return cluster.mongo


S = TypeVar("S")


def open_routed(
    cluster: Servers,
    attempt: Callable[[Router, Placement], S],
    policy: RoutedOpen,
    on_refused: Callable[[Placement, RetryableError], None] | None = None,
    on_retry: Callable[[Placement, RetryableError], None] | None = None,
    refused: tuple[Placement, RetryableError] | None = None,
) -> S:
    """Route ``policy``'s briefcase, open and ownership-check its shard with ``attempt``; retry as ``policy`` says.

    The sync driver of :class:`mdb.retry.RoutedOpen` (the async one is ``AsyncStore._open_routed``;
    both only do what the policy says), for SQL sessions and document contexts: ``attempt``
    opens the server's session and runs the kind's ownership check (releasing what it opened
    when it raises); a :class:`~mdb.errors.RetryableError` (a fence, a re-stamped layout, a move
    in progress) goes to the policy, which follows the fence, waits, or asks for a map refresh,
    so a stale route costs a retry, never a wrong write. ``on_refused`` and ``on_retry`` see
    each refusal before and after the wait (telemetry). ``refused``: a refusal the caller met
    before it made ``policy``, at the placement the policy has placed first (a kept route tried
    without a policy, as ``Store`` does): it is handled as the loop's first refusal.
    """
    while True:
        if refused is None:
            router = cluster.router
            placement = policy.placement(router)
            try:
                return attempt(router, placement)
            except RetryableError as exc:
                refused = (placement, exc)
        placement, error = refused
        refused = None
        if on_refused is not None:
            on_refused(placement, error)
        step = policy.refused(placement, error)
        if step.delay:
            time.sleep(step.delay)
        if on_retry is not None:
            on_retry(placement, error)
        if step.refresh:
            cluster.refresh()
