"""Index changes of document areas on every MongoDB server: ``status`` and ``up`` (docs/migrations.md).

A document area has no Alembic history: its schema is what its document types declare, the
collections and their indexes (:meth:`DocumentBriefcaseType.indexes_of`: the declared ones and
the key index mdb adds to every child collection). Taking a server "up" means making its
indexes of the area's collections what the types declare now: create the missing ones, drop
the ones mdb created that no type declares any more. The target is named after the declared
set, ``indexes@<hash>`` (:func:`declared_hash`), so the ledger shows which set a run rolled out.

Which indexes mdb may drop: only the ones it manages, never a DBA's own. An index is managed
when its name starts with ``mdb_`` (the prefix is mdb's: the key indexes) or when the server's
``mdb_managed_indexes`` collection records it. ``up`` records every declared index there
*before* creating it, and forgets an index only *after* dropping it, so a run killed at any
point leaves every index it created recorded. Indexes created by ``mdb schema apply`` before the
first ``up`` are recorded by that ``up`` (they are declared then); an index removed from the
types before any ``up`` ever ran was never recorded, and is reported as "other" and left alone.

Resume needs no bookkeeping: every run reads each server's indexes again and does only what
differs; creating an index that exists with the same options and dropping one that is gone are
the end state already, so a rerun after SIGKILL finishes exactly what is left. An index whose
declaration changed under the same name (keys, uniqueness, options) is never rebuilt in place:
the server fails with the difference named (give the changed index a new name, roll it out,
then remove the old one: expand/contract). A unique index that a server's documents violate
fails that server (MongoDB refuses to build it) and stops the rollout like a failed revision.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from mdb.backends import backend_of, documents_of
from mdb.cluster import Cluster
from mdb.errors import MdbError, MigrationError
from mdb.faults import fault_point
from mdb.migrations.fleet import ALREADY, DONE, FAILED, PLANNED, MigrationRun, ServerResult, Target, roll_out, targets
from mdb.mongo.store import MongoStore
from mdb.parallel import DEFAULT_PARALLEL, run_each

__all__ = [
    "MANAGED",
    "DeclaredIndex",
    "DocumentStatus",
    "declared_hash",
    "declared_indexes",
    "document_areas",
    "document_status",
    "document_targets",
    "migrate_documents",
]

MANAGED: Final = "mdb_managed_indexes"
"""Per server: one document per index ``mdb migrate up`` manages (``_id`` = ``area:collection.name``)."""

_RESERVED_PREFIX: Final = "mdb_"
_NOT_OPTIONS: Final = frozenset({"key", "v", "ns", "unique"})
"""Fields of ``index_information()`` that are not the index's options (or are compared on their own)."""


@dataclass(frozen=True)
class DeclaredIndex:
    """One index of one collection, normalised so a declared one and a live one compare equal."""

    collection: str
    name: str
    keys: tuple[tuple[str, Any], ...]
    unique: bool = False
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, collection: str, name: str, keys: Any, unique: bool, options: Mapping[str, Any]) -> DeclaredIndex:
        return cls(collection, name, tuple((str(k), _direction(d)) for k, d in keys), bool(unique),
                   tuple(sorted((k, _canonical(v)) for k, v in options.items())))

    @classmethod
    def live(cls, collection: str, name: str, info: Mapping[str, Any]) -> DeclaredIndex:
        """An index as ``index_information()`` reports it."""
        return cls.of(collection, name, info["key"], bool(info.get("unique", False)),
                      {k: v for k, v in info.items() if k not in _NOT_OPTIONS})

    def shape(self) -> str:
        """Keys, uniqueness and options as one text (what must match between declared and live)."""
        keys = ", ".join(f"{k}: {d}" for k, d in self.keys)
        extra = "".join(f", {k}={v}" for k, v in self.options)
        return f"{{{keys}}}" + (" unique" if self.unique else "") + extra

    def __str__(self) -> str:
        return f"{self.collection}.{self.name} {self.shape()}"


def _direction(value: Any) -> Any:
    """1 and 1.0 are one direction (MongoDB reports what it stored, e.g. floats from a shell)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _canonical(value: Any) -> Any:
    """Option values as JSON text, so nested filters compare and hash regardless of key order."""
    return json.dumps(value, sort_keys=True, default=str)


def _mongo(cluster: Cluster) -> MongoStore:
    """The cluster's document side; a map with MongoDB servers but no document side attached is refused."""
    try:
        mongo = documents_of(cluster)
    except TypeError:
        mongo = None
    if not isinstance(mongo, MongoStore):
        raise MigrationError("this cluster has MongoDB servers but no document side attached (MongoStore.attach)")
    return mongo


def document_areas(cluster: Cluster) -> list[str]:
    """The areas whose shards are MongoDB servers, in map order."""
    router = cluster.router
    return [a for a in router.area_names()
            if router.area_servers(a) and all(backend_of(cluster.map, s).declares_indexes for s in router.area_servers(a))]


def _areas(cluster: Cluster, areas: list[str] | None) -> list[str]:
    documents = document_areas(cluster)
    if areas is None:
        return documents
    wrong = [a for a in areas if a not in documents]
    if wrong:
        raise MigrationError(f"not document area(s): {', '.join(wrong)} (the map's document areas: {', '.join(documents) or 'none'})")
    return list(areas)


def document_targets(cluster: Cluster, areas: list[str] | None = None) -> list[Target]:
    """Every (document area, MongoDB server) holding the area's collections: shards, spares, relocation targets."""
    return targets(cluster, _areas(cluster, areas), capable=lambda b: b.declares_indexes)


def declared_indexes(cluster: Cluster, area: str) -> list[DeclaredIndex]:
    """Every index the area's document types declare, the key indexes included, in declaration order."""
    out: list[DeclaredIndex] = []
    for dtype in _mongo(cluster).types_of(area):
        for collection in dtype.collections:
            out += [DeclaredIndex.of(collection, i.index_name, i.keys, i.unique, i.options) for i in dtype.indexes_of(collection)]
    return out


def declared_hash(indexes: list[DeclaredIndex]) -> str:
    """``indexes@<12 hex>``: names a declared set (order does not matter), the target of a run."""
    text = "\n".join(sorted(str(i) for i in indexes))
    return "indexes@" + hashlib.sha256(text.encode()).hexdigest()[:12]


# -- one server --------------------------------------------------------------------------------


@dataclass
class _Comparison:
    missing: list[DeclaredIndex] = field(default_factory=list)
    extra: list[DeclaredIndex] = field(default_factory=list)
    """Managed indexes no type declares any more: ``up`` drops them."""
    differing: list[tuple[DeclaredIndex, DeclaredIndex]] = field(default_factory=list)
    """(declared, live) with the same name and a different shape: refused, never rebuilt."""
    other: list[DeclaredIndex] = field(default_factory=list)
    """Indexes mdb does not manage (a DBA's own): reported, left alone."""
    forgotten: list[str] = field(default_factory=list)
    """Records of managed indexes that are gone and no longer declared (a run killed after a drop)."""
    live_managed: list[DeclaredIndex] = field(default_factory=list)
    recorded: set[str] = field(default_factory=set)
    """Ids of the area's records in :data:`MANAGED` on the server."""


def _record_id(area: str, collection: str, name: str) -> str:
    return f"{area}:{collection}.{name}"


def _compare(db: Any, area: str, declared: list[DeclaredIndex]) -> _Comparison:
    """How the area's collections on ``db`` differ from ``declared``."""
    result = _Comparison()
    recorded = result.recorded = {doc["_id"] for doc in db[MANAGED].find({"area": area}, {"_id": 1})}
    wanted = {(i.collection, i.name): i for i in declared}
    collections = sorted({i.collection for i in declared} | {doc["collection"] for doc in db[MANAGED].find({"area": area})})
    existing = set(db.list_collection_names())
    seen: set[str] = set()
    for collection in collections:
        info = db[collection].index_information() if collection in existing else {}
        for name, spec in info.items():
            if name == "_id_":
                continue
            live = DeclaredIndex.live(collection, name, spec)
            key = _record_id(area, collection, name)
            seen.add(key)
            want = wanted.get((collection, name))
            managed = key in recorded or name.startswith(_RESERVED_PREFIX)
            if want is not None:
                if want.shape() != live.shape():
                    result.differing.append((want, live))
                result.live_managed.append(live)
            elif managed:
                result.extra.append(live)
                result.live_managed.append(live)
            else:
                result.other.append(live)
        result.missing += [i for i in declared if i.collection == collection and i.name not in info]
    result.forgotten = sorted(r for r in recorded - seen if tuple(r.split(":", 1)[1].split(".", 1)) not in wanted)
    return result


@dataclass
class DocumentStatus:
    """One document area on one MongoDB server against the declared indexes."""

    area: str
    server: str
    roles: tuple[str, ...]
    target: str
    current: str | None = None
    """``indexes@<hash>`` of the managed indexes the server has (equal to ``target`` when at it)."""
    missing: list[DeclaredIndex] = field(default_factory=list)
    extra: list[DeclaredIndex] = field(default_factory=list)
    differing: list[tuple[DeclaredIndex, DeclaredIndex]] = field(default_factory=list)
    other: list[DeclaredIndex] = field(default_factory=list)
    error: str | None = None

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        if self.differing:
            return "differs"
        if self.missing or self.extra:
            return "behind"
        return "at target"

    @property
    def ok(self) -> bool:
        """Behind is a state (``up`` fixes it), like SQL servers behind head; differing needs a person."""
        return self.state in ("at target", "behind")


def _failure(cluster: Cluster, server: str, exc: Exception) -> str:
    translated = _mongo(cluster).translate(server, exc)
    if translated is not None:
        return str(translated)
    return f"server {server!r}: {type(exc).__name__}: {exc}"


def _driver_errors() -> tuple[type[Exception], ...]:
    import pymongo.errors  # late: pymongo is an optional dependency, needed only when a map has MongoDB servers

    return (MdbError, pymongo.errors.PyMongoError)


def document_status(
    cluster: Cluster, *, areas: list[str] | None = None, parallel: int = DEFAULT_PARALLEL,
    on_done: Callable[[DocumentStatus], None] | None = None,
) -> list[DocumentStatus]:
    """Every document target against its area's declared indexes; a server that cannot be read is reported, the others still read."""
    work = document_targets(cluster, areas)
    if not work:  # a map without document areas: pymongo (optional) is not needed
        return []
    declared = {t.area: declared_indexes(cluster, t.area) for t in work}
    errors = _driver_errors()

    def one(target: Target) -> DocumentStatus:
        status = DocumentStatus(target.area, target.server, target.roles, declared_hash(declared[target.area]))
        try:
            diff = _compare(_mongo(cluster).database(target.server), target.area, declared[target.area])
        except errors as exc:
            status.error = _failure(cluster, target.server, exc)
            return status
        status.current = declared_hash(diff.live_managed)
        status.missing, status.extra, status.differing, status.other = diff.missing, diff.extra, diff.differing, diff.other
        return status

    return run_each(work, one, parallel=parallel, on_done=on_done, name="mdb-migrate-status-docs")


# -- up ----------------------------------------------------------------------------------------


def _up_one(cluster: Cluster, target: Target, declared: list[DeclaredIndex], goal: str, dry_run: bool) -> ServerResult:
    """Create the missing and drop the extra managed indexes of one area on one server; the failure is in the result."""
    result = ServerResult(target.area, target.server, target.roles, goal)
    started = time.monotonic()
    try:
        db = _mongo(cluster).database(target.server)
        diff = _compare(db, target.area, declared)
        result.before = declared_hash(diff.live_managed)
        result.before_read = True
        result.steps = [f"create {i}" for i in diff.missing] + [f"drop {i.collection}.{i.name}" for i in diff.extra]
        if diff.differing:
            result.outcome = FAILED
            result.detail = f"server {target.server!r}: " + "; ".join(
                f"index {want.collection}.{want.name} is {live.shape()} here but declared {want.shape()}" for want, live in diff.differing
            ) + " (an index is never rebuilt under its name: declare the new one under a new name, roll it out, then drop the old)"
            return result
        if dry_run:
            result.outcome, result.after = (PLANNED if result.steps else ALREADY), result.before
            return result
        records = db[MANAGED]
        for index in declared:  # adopt what exists (schema apply made it): it is mdb's to drop later
            if _record_id(target.area, index.collection, index.name) in diff.recorded:
                continue
            records.update_one({"_id": _record_id(target.area, index.collection, index.name)},
                               {"$set": {"area": target.area, "collection": index.collection, "name": index.name}}, upsert=True)
        for index in diff.missing:
            try:
                db[index.collection].create_index(list(index.keys), name=index.name, unique=index.unique,
                                                  **{k: json.loads(v) for k, v in index.options})
            except Exception:
                records.delete_one({"_id": _record_id(target.area, index.collection, index.name)})  # it was never built
                raise
        for index in diff.extra:
            db[index.collection].drop_index(index.name)
            records.delete_one({"_id": _record_id(target.area, index.collection, index.name)})
        for record in diff.forgotten:
            records.delete_one({"_id": record})
        result.after = goal
        result.outcome = DONE if result.steps else ALREADY
        fault_point("migrate.after_server")
    except _driver_errors() as exc:
        result.outcome, result.detail = FAILED, _failure(cluster, target.server, exc)
    finally:
        result.seconds = time.monotonic() - started
    return result


def migrate_documents(
    cluster: Cluster,
    *,
    areas: list[str] | None = None,
    servers: list[str] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    canary: str | None = None,
    dry_run: bool = False,
    on_done: Callable[[ServerResult], None] | None = None,
) -> MigrationRun:
    """Take every document target of ``areas`` (default: every document area) to its declared indexes.

    The same rollout as SQL areas (:func:`mdb.migrations.fleet.roll_out`): canary first, then
    ``parallel`` at a time, the first failure stops new starts, one ledger row per server with
    the target ``indexes@<hash>``.
    """
    work = document_targets(cluster, areas)
    if servers is not None:
        unknown = sorted(set(servers) - {t.server for t in work})
        if unknown:
            raise MigrationError(f"server(s) {', '.join(unknown)} hold no collections of the document areas being migrated")
        work = [t for t in work if t.server in servers]
    declared = {area: declared_indexes(cluster, area) for area in {t.area for t in work}}
    goals = {area: declared_hash(indexes) for area, indexes in declared.items()}
    destinations: dict[str, str | None] = dict(goals)
    run = MigrationRun(uuid.uuid4().hex, "up", destinations, [], dry_run)

    def one(target: Target) -> ServerResult:
        return _up_one(cluster, target, declared[target.area], goals[target.area], dry_run)

    roll_out(cluster, run, work, one, parallel=parallel, canary=canary, on_done=on_done)
    return run
