"""Server identity: which database a server name stands for, so a mistyped URL is refused.

A map names a server by a URL, and a URL can be wrong in a way no map check sees: a typo in the
database name reaches another (often empty) database that answers like the right one. Trusting
it re-routes existing data (docs/design.md invariant 4): reads of half the briefcases find
nothing, new briefcases land in the wrong database, and CENTRAL's repair would take their
index entries for dangling. So each SQL server database carries an **identity**, a random
UUID written once into ``mdb_server_identity`` (a shard system table, created by ``mdb schema
apply`` and ``mdb map apply`` like the layout stamp), and CENTRAL records, per server name,
the identity its database had when the name was first applied (``mdb_server_ids``, on the
CENTRAL shard that holds the map history, :func:`mdb.maps.history.maps_server`).

The one rule (:func:`identity_problem`): a server whose name CENTRAL recorded must reach a
database carrying that identity; a database with another identity, or none, is another
database, and ``map check``, ``map apply`` and ``schema apply`` refuse it, naming the server,
both URLs (masked) and both identities. A name CENTRAL never recorded is adopted: its database
gets an identity if it has none and CENTRAL records it (a new server, or a fleet that predates
identities). MongoDB servers carry no identity yet and are not checked.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

from sqlalchemy import Column, DateTime, Integer, String, Table, Text, func, insert, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError

from mdb.backends import backend_of
from mdb.backends.sql import create_tables
from mdb.cluster import Cluster
from mdb.errors import DuplicateRowError, MdbError
from mdb.maps.history import maps_server
from mdb.parallel import DEFAULT_PARALLEL, run_each
from mdb.partition_map import PartitionMap, sqlite_file
from mdb.system_tables import central_metadata, shard_metadata
from mdb.urls import mask_url

__all__ = [
    "IdentityFinding",
    "Recorded",
    "adopt",
    "ensure_on",
    "identity_problem",
    "identity_table",
    "read_identity",
    "record_identities",
    "recorded_identities",
    "server_ids",
    "survey",
]

identity_table = Table(
    "mdb_server_identity",
    shard_metadata,
    # Always 1: one identity per database, and two concurrent first writers cannot both win.
    Column("slot", Integer, primary_key=True, autoincrement=False),
    Column("identity", String(36), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
)

server_ids = Table(
    "mdb_server_ids",
    central_metadata,
    Column("server", String(63), primary_key=True),
    Column("identity", String(36), nullable=False),
    # The URL (masked) that reached the database when it was recorded: for the refusal text.
    Column("url", Text, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
)


@dataclass(frozen=True)
class Recorded:
    """What CENTRAL recorded for a server name: its database's identity and the URL that reached it."""

    identity: str | None
    url: str
    recorded_at: datetime | None = None
    central: bool = True
    """False: not a CENTRAL record but what the server's old URL reaches (a name recorded before identities)."""


Verdict = Literal["ok", "new", "unconfirmed", "refused", "unreachable", "not-checked"]


@dataclass(frozen=True)
class IdentityFinding:
    """One server's identity as its URL reaches it, against CENTRAL's record; ``problem`` when refused."""

    server: str
    url: str
    live: str | None
    recorded: Recorded | None
    verdict: Verdict
    problem: str | None = None
    error: Exception | None = None
    """Why an ``unreachable`` server did not answer (a command re-raises it: exit 3, like any down server)."""

    def to_json(self) -> dict[str, object]:
        return {"server": self.server, "url": self.url, "identity": self.live,
                "recorded": None if self.recorded is None else {"identity": self.recorded.identity, "url": self.recorded.url},
                "verdict": self.verdict, "problem": self.problem}


# -- on a server -------------------------------------------------------------------------------


def read_identity(conn: Connection) -> str | None:
    """The identity of ``conn``'s database, or None when it has none (no table, or no row)."""
    if not sa_inspect(conn).has_table(identity_table.name):
        return None
    value = conn.execute(select(identity_table.c.identity).where(identity_table.c.slot == 1)).scalar()
    return None if value is None else str(value)


def ensure_identity(conn: Connection) -> str:
    """The identity of ``conn``'s database, written first (a new UUID) if it has none.

    The table must exist (``create_tables`` made it). A concurrent first writer makes the insert
    fail on the fixed key; the caller's transaction is then rolled back and a retry reads theirs.
    """
    current = read_identity(conn)
    if current is not None:
        return current
    new = str(uuid.uuid4())
    conn.execute(insert(identity_table).values(slot=1, identity=new))
    return new


# -- in CENTRAL --------------------------------------------------------------------------------


def recorded_identities(cluster: Cluster) -> dict[str, Recorded]:
    """server name -> what CENTRAL recorded for it (empty before the first apply recorded any)."""
    pmap = cluster.map
    server = maps_server(pmap)
    if _not_sql_or_missing(pmap, server):
        return {}
    with cluster.transaction(server) as conn:
        if not sa_inspect(conn).has_table(server_ids.name):
            return {}
        rows = conn.execute(select(server_ids.c.server, server_ids.c.identity, server_ids.c.url, server_ids.c.recorded_at))
        return {name: Recorded(identity, url, at) for name, identity, url, at in rows}


def record_identities(cluster: Cluster, found: Mapping[str, tuple[str, str]]) -> list[str]:
    """Record ``found`` (server -> (identity, masked URL)) in CENTRAL where a name has no record yet.

    Returns the names recorded now. A name recorded meanwhile with another identity (two applies
    racing) is an error: the record is never overwritten, so a mistake cannot replace the truth.
    """
    if not found:
        return []
    pmap = cluster.map
    server = maps_server(pmap)
    if not backend_of(pmap, server).keeps_records:
        return []  # the history, and the records beside it, live on SQL CENTRAL servers only
    with cluster.transaction(server) as conn:
        create_tables(conn, [server_ids])
        have = {n: i for n, i in conn.execute(select(server_ids.c.server, server_ids.c.identity))}
        new = {name: value for name, value in found.items() if name not in have}
        for name, (identity, _) in found.items():
            if name in have and have[name] != identity:
                raise MdbError(f"server {name!r}: CENTRAL recorded identity {have[name]} meanwhile, not {identity}; "
                               "nothing was recorded (run the command again)")
        if new:
            conn.execute(insert(server_ids), [{"server": n, "identity": i, "url": u} for n, (i, u) in new.items()])
    return sorted(new)


# -- the rule ----------------------------------------------------------------------------------


def identity_problem(server: str, url: str, live: str | None, recorded: Recorded | None) -> str | None:
    """Why ``server``'s URL (``url``, masked) may not be used, or None: the one rule every command applies."""
    if recorded is None or live == recorded.identity:
        return None
    reached = f"a database with identity {live}" if live is not None else "a database that carries no mdb identity"
    if recorded.central:
        known = f"CENTRAL recorded {server!r} as the database with identity {recorded.identity} (reached at {recorded.url})"
    else:
        has = f"identity {recorded.identity}" if recorded.identity else "no mdb identity"
        known = f"its URL in the map the system runs, {recorded.url}, reaches the database with {has}"
    return (f"server {server!r}: {url} reaches {reached}, but {known}: the URL leads to another database; correct the URL "
            "(a database is never taken over by a server name another database holds)")


def _not_sql_or_missing(pmap: PartitionMap, server: str) -> bool:
    """A server whose identity cannot be read without a side effect: not SQL, or a SQLite file not there yet."""
    if not backend_of(pmap, server).has_identity:
        return True
    database = sqlite_file(pmap.servers[server].primary)
    return database is not None and not Path(database).exists()


def _live(reach: Cluster, name: str) -> str | None:
    """The identity ``reach``'s URL for ``name`` leads to (None for a SQLite file not created yet: no side effect)."""
    if _not_sql_or_missing(reach.map, name):
        return None
    with reach.transaction(name) as conn:
        return read_identity(conn)


def survey(
    central: Cluster, reach: Cluster, servers: Iterable[str] | None = None, *,
    old: Cluster | None = None, records: Mapping[str, Recorded] | None = None, parallel: int = DEFAULT_PARALLEL,
) -> list[IdentityFinding]:
    """Each server's identity as ``reach`` (a cluster on the map under test) reaches it, against the
    records in ``central``'s CENTRAL; reads only, ``parallel`` servers at a time.

    ``servers`` defaults to every server of ``reach``'s map. A name CENTRAL has no record of whose
    URL differs in ``old`` (a cluster on the map the system runs) is compared with the database
    the old URL reaches instead; when neither carries an identity yet (a fleet from before
    identities, in a dry run) the finding is ``unconfirmed``. A server that does not answer is
    ``unreachable``, with the error in ``error``: an unknown identity is not a match.
    """
    pmap = reach.map
    names = list(pmap.servers if servers is None else servers)
    known = recorded_identities(central) if records is None else records

    def one(name: str) -> IdentityFinding:
        url = mask_url(pmap.servers[name].primary)
        recorded = known.get(name)
        if not backend_of(pmap, name).has_identity:
            return IdentityFinding(name, url, None, recorded, "not-checked")
        try:
            live = _live(reach, name)
        except (MdbError, DBAPIError) as exc:
            return IdentityFinding(name, url, None, recorded, "unreachable",
                                   f"server {name!r}: its identity cannot be read at {url}: {exc}", exc)
        if recorded is None and old is not None and name in old.map.servers:
            before = old.map.servers[name].primary
            if before != pmap.servers[name].primary and backend_of(old.map, name).has_identity:
                try:
                    was = _live(old, name)
                except (MdbError, DBAPIError) as exc:  # the old address is gone: nothing to compare with
                    return IdentityFinding(name, url, live, None, "unconfirmed",
                                           f"server {name!r}: no identity recorded and its old URL {mask_url(before)} does "
                                           f"not answer ({exc}): the new URL cannot be confirmed")
                if was is None and live is None:
                    return IdentityFinding(name, url, live, None, "unconfirmed",
                                           f"server {name!r}: neither {mask_url(before)} nor {url} carries an identity yet; "
                                           "map apply gives the old one an identity first and refuses a new URL that reaches another database")
                recorded = Recorded(was, mask_url(before), central=False)
        problem = identity_problem(name, url, live, recorded)
        if problem is not None:
            return IdentityFinding(name, url, live, recorded, "refused", problem)
        return IdentityFinding(name, url, live, recorded, "ok" if recorded is not None else "new")

    return run_each(names, one, parallel=parallel, name="mdb-identity")


def adopt(reach: Cluster, servers: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Give each SQL server of ``servers`` an identity if its database has none; server -> (identity, masked URL).

    Creates ``mdb_server_identity`` where missing. The caller records the result in CENTRAL
    (:func:`record_identities`) after checking the servers against what CENTRAL holds.
    """
    out: dict[str, tuple[str, str]] = {}
    for name in servers:
        if not _not_sql_or_missing(reach.map, name):
            out[name] = (ensure_on(reach, name), mask_url(reach.map.servers[name].primary))
    return out


def ensure_on(reach: Cluster, name: str) -> str:
    """``ensure_identity`` on server ``name`` in its own transaction; a lost first-writer race reads the winner's."""
    try:
        with reach.transaction(name) as conn:
            create_tables(conn, [identity_table])
            return ensure_identity(conn)
    except (DuplicateRowError, IntegrityError):
        with reach.transaction(name) as conn:
            found = read_identity(conn)
        if found is None:
            raise
        return found
