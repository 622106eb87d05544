"""Where a hot-data operation runs: one open transaction, in a briefcase or on a CENTRAL shard.

Every operation of :mod:`mdb.hot` takes a *place* instead of a bare connection, so that:

- the effect of a calculation, its stats-lock record and the business write share ONE
  transaction (a place exists only inside an open transaction, and operations refuse a
  connection that is not in one: on PostgreSQL mdb's engines autocommit outside ``begin``);
- briefcase tables are written with the session's briefcase key and only when they belong to
  the session's briefcase type (otherwise the rows would not move with the briefcase);
- CENTRAL rows land on the shard their key routes to (``router.locate_central``).

A :class:`~mdb.session.BriefcaseSession` is accepted wherever a place is; CENTRAL places come
from :func:`central`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table, select
from sqlalchemy.engine import Connection

from mdb.briefcase import BriefcaseType
from mdb.dialects import sql_dialect
from mdb.errors import CrossBriefcaseError, MdbError, RoutingError, StatsError
from mdb.gdid import GDID
from mdb.session import BriefcaseSession

if TYPE_CHECKING:
    from mdb.cluster import Cluster

__all__ = ["Scope", "central", "central_server", "insert_once", "place_of"]


@dataclass(frozen=True)
class Scope:
    """An open transaction on ``server``: a briefcase's (``key`` set) or a CENTRAL shard's."""

    conn: Connection
    server: str
    key: GDID | None = None
    btype: type[BriefcaseType] | None = None
    store: Cluster | None = None
    readonly: bool = False

    @property
    def where(self) -> str:
        if self.btype is not None:
            return f"briefcase {self.btype.area}/{self.key}"
        return f"CENTRAL shard {self.server!r}"

    def check(self, tables: tuple[Table, ...], key_column: str | None, *, write: bool) -> None:
        """Refuse tables of the wrong shape for this place, writes in a readonly place, no transaction."""
        if not self.conn.in_transaction():
            raise MdbError(f"{self.where}: not in a transaction (hot-data operations run inside one)")
        if write and self.readonly:
            raise MdbError(f"{self.where}: a readonly place cannot write {tables[0].name!r}")
        if self.btype is None:
            if key_column is not None:
                raise CrossBriefcaseError(
                    f"table {tables[0].name!r} carries the briefcase key {key_column!r}: use it in a briefcase session, not on CENTRAL"
                )
            return
        if key_column != self.btype.key:
            raise CrossBriefcaseError(
                f"table {tables[0].name!r} is not keyed by {self.btype.key!r}: it cannot be used in {self.where}"
            )
        mine = set(self.btype.tables)
        for table in tables:
            if table not in mine:
                raise CrossBriefcaseError(
                    f"table {table.name!r} is not part of briefcase type {self.btype.__name__} "
                    "(list its models in the type's children so it moves with the briefcase)"
                )

    def check_routed(self, key: str) -> None:
        """On CENTRAL, refuse a key whose rows belong on another CENTRAL shard."""
        if self.btype is not None or self.store is None:
            return
        server = self.store.router.locate_central(key).server
        if server != self.server:
            raise RoutingError(
                f"CENTRAL key {key!r} lives on shard {server!r}, but this transaction is on {self.server!r}: "
                f"open it with stats.central(store, {key!r})"
            )

    def key_values(self) -> dict[str, Any]:
        """The briefcase key column and value every row written here carries ({} on CENTRAL)."""
        if self.btype is None:
            return {}
        return {self.btype.key: self.key}


def place_of(target: Scope | BriefcaseSession) -> Scope:
    if isinstance(target, Scope):
        return target
    if isinstance(target, BriefcaseSession):
        ctx = target.briefcase
        return Scope(target.connection(), ctx.placement.server, ctx.gdid, ctx.btype, None, ctx.readonly)
    raise TypeError(
        f"expected a BriefcaseSession or a stats.central(...) place, got {type(target).__name__} "
        "(a bare connection could be outside a transaction or on the wrong shard)"
    )


@contextmanager
def central(store: Cluster, key: str, *, readonly: bool = False) -> Iterator[Scope]:
    """One transaction on the CENTRAL shard of ``key`` (commit on success, rollback on error)."""
    server = store.router.locate_central(key).server
    with store.transaction(server, readonly=readonly) as conn:
        yield Scope(conn, server, store=store, readonly=readonly)


@contextmanager
def central_server(store: Cluster, server: str) -> Iterator[Scope]:
    """A transaction on one named CENTRAL server (for jobs that walk every CENTRAL shard)."""
    if server not in store.router.central_servers():
        raise RoutingError(f"server {server!r} is not a CENTRAL shard (CENTRAL: {store.router.central_servers()})")
    with store.transaction(server) as conn:
        yield Scope(conn, server, store=None)


def insert_once(place: Scope, table: Table, id_column: str, values: Mapping[str, Any], natural: Sequence[str]) -> bool:
    """Insert a row with a derived id unless its natural key is already there; True if inserted.

    ``ON CONFLICT DO NOTHING`` without a target, because the row is unique twice (derived id
    and natural key) and a concurrent duplicate may hit either index first. "Nothing
    inserted" then means "already there" only if a row with this natural key exists: if none
    does, the derived id is held by a row with ANOTHER natural key (a hash collision, or a row
    written under an ambiguous encoding), and counting that as "already there" would silently
    drop this row's effect. That raises instead.
    """
    stmt = (
        sql_dialect(place.conn).insert(table)
        .values(**place.key_values(), **values)
        .on_conflict_do_nothing()
        .returning(table.c[id_column])
    )
    if place.conn.execute(stmt).first() is not None:  # RETURNING: rowcount is not reliable on every driver
        return True
    conds = [table.c[k] == v for k, v in place.key_values().items()]
    conds += [table.c[column] == values[column] for column in natural]
    if place.conn.execute(select(table.c[id_column]).where(*conds)).first() is None:
        key = ", ".join(f"{column}={values[column]!r}" for column in natural)
        raise StatsError(
            f"{place.where}: derived id {values[id_column]} of {table.name!r} row ({key}) is already used by another row "
            "(a derived-id clash); refusing to treat it as already there"
        )
    return False
