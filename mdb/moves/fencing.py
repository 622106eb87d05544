"""Fencing tokens: a driver whose lease was taken over cannot write anywhere (DESIGN.md invariant 7).

A lease (:mod:`mdb.moves.lease`) says who *should* drive a move; it cannot stop a driver that
was paused past it (a VM freeze, a long GC, SIGSTOP) from waking up and carrying on before it
reads that its lease is gone. That driver's commit point on the source, after the new driver
discarded the target copy, lost every row of the batch. So every lease take
increments the lease's **epoch**, and every server a driver writes to records the highest epoch
it has seen for that lease in ``mdb_lease_fences``:

* **claim** (at every take, on every server the entry may touch, before the new driver reads
  anything): raise the server's epoch to the new one. On PostgreSQL the update waits for every
  transaction of the old driver that already passed its check (they hold the row ``FOR SHARE``),
  so once a claim returns, no write of the old driver can still commit there.
* **check** (first statement of every transaction a driver opens through a
  :class:`FencedCluster`): read the epoch ``FOR SHARE`` and go on only if it is the driver's own;
  a higher one raises :class:`mdb.errors.LeaseLostError` and the transaction rolls back. A server
  first touched after the take is claimed there and then, in the same transaction. The read
  travels with BEGIN in one round trip (:class:`FenceCheck`, a BEGIN prelude like the
  ownership check): a batch opens five or so fenced transactions, each one round trip fewer.

Shared row locks do not conflict with each other, so the parallel batches of one reshard do
not queue on the fence row; only a takeover waits. SQLite has one writer at a time, so a
transaction that read an older epoch cannot commit after a claim committed. Document
(MongoDB) servers are not fenced: a document move's driver is covered by its lease alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Engine, insert, select, update
from sqlalchemy.engine import Connection

from mdb.backends import backend_of
from mdb.briefcase import BriefcaseType
from mdb.cluster import Cluster
from mdb.dialects import sql_dialect
from mdb.engines import BeginPrelude, Rows, simple_query, take_result
from mdb.errors import LeaseLostError
from mdb.gdid import GDID
from mdb.partition_map import PartitionMap
from mdb.registry import Registry
from mdb.router import Router
from mdb.system_tables import lease_fences

if TYPE_CHECKING:
    from mdb.engines import EngineRegistry
    from mdb.session import BriefcaseSession

log = logging.getLogger("mdb.moves.fencing")

__all__ = ["FencedCluster", "check", "claim", "ending_blockers", "fence_check", "lease_fences", "unchecked"]

_ensured: set[str] = set()
_ensured_lock = threading.Lock()


def _ensure_table(cluster: Cluster, server: str) -> None:
    """Create ``mdb_lease_fences`` on ``server`` once per process and database (fleets from before it have none).

    Keyed by the database's URL, not by a server name or an object's id: both are reused for
    other databases within one process (a test suite, a tool serving several maps).
    """
    key = cluster.engine(server).url.render_as_string(hide_password=True)
    if key in _ensured:
        return
    with _ensured_lock:
        if key in _ensured:
            return
        with cluster.transaction(server) as conn:
            lease_fences.create(conn, checkfirst=True)
        _ensured.add(key)


def _raise_or_take(conn: Connection, server: str, lease_id: str, epoch: int, seen: int | None) -> None:
    """Given the epoch ``seen`` on ``server``: a newer one is a lost lease; an older or none is raised to ``epoch`` here."""
    if seen is not None and seen > epoch:
        raise LeaseLostError(
            f"{lease_id}: server {server!r} has seen lease epoch {seen}, this driver holds epoch {epoch}: another "
            "process took the lease over, so this driver stops without writing"
        )
    if seen is None:
        conn.execute(insert(lease_fences).values(lease_id=lease_id, epoch=epoch))
    elif seen < epoch:
        conn.execute(update(lease_fences).where(lease_fences.c.lease_id == lease_id).values(epoch=epoch))


def check(conn: Connection, server: str, lease_id: str, epoch: int) -> None:
    """In the caller's transaction: this driver's epoch is current on ``server`` (claimed here if new), or raise."""
    seen = conn.execute(
        select(lease_fences.c.epoch).where(lease_fences.c.lease_id == lease_id).with_for_update(read=True)
    ).scalar_one_or_none()
    if seen != epoch:
        _raise_or_take(conn, server, lease_id, epoch, seen)


def _judge(conn: Connection, server: str, lease_id: str, epoch: int, rows: Rows) -> None:
    seen = int(rows[0][0]) if rows else None
    if seen != epoch:
        _raise_or_take(conn, server, lease_id, epoch, seen)


class FenceCheck:
    """The fence check's read as a :class:`mdb.engines.BeginPrelude`: sent with BEGIN, in its round trip.

    The same statement as :func:`check` (the epoch row ``FOR SHARE``), in the same transaction;
    :meth:`FencedCluster.transaction` judges the row BEGIN returned.
    """

    __slots__ = ("lease_id",)
    read_only = False  # a mover's transaction writes

    def __init__(self, lease_id: str) -> None:
        self.lease_id = lease_id

    def _pg(self, connection: Any) -> Rows | None:
        quoted = "'" + self.lease_id.replace("'", "''") + "'"  # standard_conforming_strings (on since PostgreSQL 9.1)
        return simple_query(connection, f"BEGIN; SELECT epoch FROM {lease_fences.name} WHERE lease_id = {quoted} FOR SHARE")

    def begin_postgresql(self, connection: Any, prepared: Any) -> Rows | None:
        return self._pg(connection)

    def begin_postgresql_pooled(self, connection: Any) -> Rows | None:
        return self._pg(connection)

    def begin_sqlite(self, cursor: Any, begin: str, known: Any) -> Rows | None:
        cursor.execute(begin)  # one writer at a time: no row lock to take
        cursor.execute(f"SELECT epoch FROM {lease_fences.name} WHERE lease_id = ?", (self.lease_id,))
        return list(cursor.fetchall())


def _fenced(pmap: PartitionMap, server: str) -> bool:
    """Whether a driver's transactions on ``server`` carry its lease check (its backend takes lease fences)."""
    return backend_of(pmap, server).takes_lease_fences


CLAIM_GRACE: Final = 2.0
"""Seconds a claim waits for the older driver's open transactions before it ends their sessions."""


def claim(cluster: Cluster, servers: Iterable[str], lease_id: str, epoch: int) -> None:
    """Raise the lease's epoch to ``epoch`` on every SQL server of ``servers`` (see the module docstring).

    Each claim is its own transaction and waits for the older driver's transactions that passed
    their check there; done before the new driver reads any state, so what it reads is final.
    A driver paused *inside* such a transaction (its locks held) would make that wait endless,
    so on PostgreSQL the sessions still blocking the claim after :data:`CLAIM_GRACE` seconds are
    terminated: only drivers of this lease lock its fence row, and ending an old driver's
    transaction before its commit point is what the source-is-authoritative rule expects.
    """
    for server in dict.fromkeys(servers):
        if not _fenced(cluster.map, server):
            continue
        _ensure_table(cluster, server)
        with cluster.transaction(server) as conn, ending_blockers(cluster, conn, server, lease_id):
            seen = conn.execute(
                select(lease_fences.c.epoch).where(lease_fences.c.lease_id == lease_id).with_for_update()
            ).scalar_one_or_none()
            _raise_or_take(conn, server, lease_id, epoch, seen)


@contextmanager
def ending_blockers(cluster: Cluster, conn: Connection, server: str, lease_id: str) -> Iterator[None]:
    """While the block runs, terminate (from a second session) whatever blocks ``conn`` past :data:`CLAIM_GRACE`.

    For statements only a driver of ``lease_id`` can be blocked by: a claim of its fence row, a
    take of its lease row (a driver paused in the middle of its heartbeat's transaction holds it).
    """
    dialect = sql_dialect(conn)
    pid = dialect.backend_pid(conn) if dialect.terminates_sessions else None
    if pid is None:  # one writer at a time (SQLite): nothing of the old driver can be inside a transaction
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(CLAIM_GRACE):
            with cluster.transaction(server) as other:
                for blocker in dialect.blocking_pids(other, pid):
                    log.warning("server %r: ending session %s, which holds lease %s's row for a driver whose lease "
                                "is being taken over (paused inside a transaction?)", server, blocker, lease_id)
                    dialect.terminate(other, blocker)

    watcher = threading.Thread(target=watch, name=f"mdb-claim-{lease_id}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


class FencedCluster:
    """A :class:`mdb.cluster.Cluster` whose every transaction first checks a lease's epoch.

    Drivers (reshard, resume, cancel, a single move) do all their work through one, so every
    write they make, on shards and on CENTRAL alike, is conditional on their lease in the same
    transaction. Everything else is the wrapped cluster's.
    """

    def __init__(self, inner: Cluster, lease_id: str, epoch: int) -> None:
        self.inner = inner
        self.lease_id = lease_id
        self.epoch = epoch

    def check(self, conn: Connection, server: str) -> None:
        """The fence check on a connection the caller began itself (:meth:`connect`)."""
        if _fenced(self.inner.map, server):
            check(conn, server, self.lease_id, self.epoch)

    @property
    def map(self) -> PartitionMap:
        return self.inner.map

    @property
    def mongo(self) -> Any:
        """The wrapped cluster's document side; AttributeError where it has none, so ``hasattr`` and the
        runtime ``HasDocuments`` check answer for the wrapped cluster."""
        return getattr(self.inner, "mongo")  # noqa: B009 - Cluster does not declare it

    @property
    def router(self) -> Router:
        return self.inner.router

    @property
    def map_path(self) -> Path | None:
        return self.inner.map_path

    @property
    def engines(self) -> EngineRegistry:
        return self.inner.engines

    @property
    def registry(self) -> Registry:
        return self.inner.registry

    @property
    def types(self) -> list[type[BriefcaseType]]:
        return self.inner.types

    def refresh(self) -> None:
        self.inner.refresh()

    def types_of(self, area: str) -> list[type[BriefcaseType]]:
        return self.inner.types_of(area)

    def engine(self, server: str, readonly: bool = False) -> Engine:
        return self.inner.engine(server, readonly)

    def connect(self, server: str, readonly: bool = False) -> Connection:
        """Unchecked: a caller that begins transactions itself calls :meth:`check` in each (:func:`fence_check`)."""
        if not readonly and _fenced(self.inner.map, server):
            _ensure_table(self.inner, server)
        return self.inner.connect(server, readonly)

    @contextmanager
    def transaction(self, server: str, readonly: bool = False, prelude: BeginPrelude | None = None) -> Iterator[Connection]:
        if prelude is not None:
            raise TypeError("a fenced transaction sends its own BEGIN prelude (the fence check); it takes no other")
        fenced = not readonly and _fenced(self.inner.map, server)
        if fenced:
            _ensure_table(self.inner, server)
        # Fenced twice (a driver's cluster wrapped by a move it runs under its own lease): the inner
        # one sends its check with BEGIN, this one checks by a statement in the same transaction.
        nested = isinstance(self.inner, FencedCluster)
        prelude = FenceCheck(self.lease_id) if fenced and not nested else None
        with self.inner.transaction(server, readonly, prelude=prelude) as conn:
            if fenced:
                rows = None if nested else take_result(conn)
                if rows is None:  # no prelude ran with this BEGIN (nested, or an engine without mdb's BEGIN)
                    check(conn, server, self.lease_id, self.epoch)
                else:
                    _judge(conn, server, self.lease_id, self.epoch, rows)
            yield conn

    def begin(self, server: str, readonly: bool = False) -> Connection:
        if not readonly and _fenced(self.inner.map, server):
            _ensure_table(self.inner, server)
        conn = self.inner.begin(server, readonly)
        if not readonly:
            try:
                self.check(conn, server)
            except BaseException:
                conn.rollback()
                conn.close()
                raise
        return conn

    def briefcase(
        self, btype: type[BriefcaseType], gdid: GDID | str, *, readonly: bool = False, exclusive: bool = False
    ) -> AbstractContextManager[BriefcaseSession]:
        return self.inner.briefcase(btype, gdid, readonly=readonly, exclusive=exclusive)


def unchecked(cluster: Cluster) -> Cluster:
    """The cluster under a fenced one, for a transaction that only reads and must set its own isolation first."""
    return cluster.inner if isinstance(cluster, FencedCluster) else cluster


def fence_check(cluster: Cluster, conn: Connection, server: str) -> None:
    """Check the fence on a connection begun by the caller, when ``cluster`` is fenced (else nothing to check)."""
    if isinstance(cluster, FencedCluster):
        cluster.check(conn, server)
