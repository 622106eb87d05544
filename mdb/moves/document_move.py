"""Moving a document briefcase between MongoDB shards: :class:`DocumentMove`, the SQL protocol on documents.

Steps, each recorded in the same move journal as SQL moves (kind ``mongo-move``; ``mdb moves
status`` lists them, ``mdb moves resume`` resolves them, ``mdb moves cancel`` handles them):

1. lock: every guard slot of the briefcase on the source gets ``locked_by = move id``; new
   write sessions wait, a write session still in flight conflicts with the lock (transactional
   servers) so it either committed before the lock or is retried after it;
2. copy: the target records the briefcase as ``incoming`` (sessions and fan-outs ignore the
   copy), then receives every document of every collection of the area's types plus their
   counter and stats-lock documents, in one transaction where the target supports it;
3. verify: document count and a SHA-256 of the documents (canonical BSON, ordered by ``_id``)
   per collection, computed on each side separately;
4. commit point: on the source, the fence (``gone``, peer = target) and the deletion of the
   source documents. With transactions it is one transaction that re-verifies the source
   first; without, the fence is written first (that single-document write is the commit
   point) and the deletions follow, finished by resume after a crash;
5. finalize: relocation directory entry (or its removal when the target is the default
   shard), target state ``resident`` (or none on the default shard), journal done.

A crash before the commit point leaves the source authoritative (resume discards the target
copy and unlocks); after it, resume finishes steps 4-5. The crash points (:data:`FAULT_POINTS`)
are in the one registry (:mod:`mdb.faults`): ``MDB_FAULT_POINT`` SIGKILLs a CLI process there
(the cross-process fake server, ``MDB_MONGO_FAKE_DIR``, survives it), ``mdb.faults.hook``
raises there in-process.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Final

from mdb import telemetry
from mdb.cluster import Cluster
from mdb.errors import MdbError, RoutingError
from mdb.faults import fault_point, register
from mdb.gdid import GDID
from mdb.moves.directory import documents_of
from mdb.relocations import set_relocation
from mdb.moves.journal import DONE, ROLLED_BACK, RUNNING, Journal, JournalEntry
from mdb.moves.move import Move, MoveOptions, MoveResult, ResumeOutcome, refuse_if_busy, register_move
from mdb.moves.plan import PartitionScan, ServerScan, register_scan
from mdb.mongo.hot import COUNTERS, STATS_LOCK
from mdb.mongo.shard_state import GUARD, STATE, excluded_gdids, guard_ids, set_guard, state_id
from mdb.mongo.store import MongoStore
from mdb.mongo.types import DocumentBriefcaseType
from mdb.system_tables import STATE_GONE, STATE_INCOMING, STATE_RESIDENT
from mdb.urls import MONGO

__all__ = ["FAULT_POINTS", "KIND", "DocumentMove", "DocumentPartitionScan", "checksums", "move_documents"]

KIND: Final = "mongo-move"
FAULT_POINTS: Final = register(
    "mongo.move.after_journal_start",
    "mongo.move.after_lock",
    "mongo.move.after_copy",
    "mongo.move.after_verify",
    "mongo.move.after_fence",
    "mongo.move.after_commit_point",
    "mongo.move.after_relocation",
    "mongo.move.after_target_state",
)
"""Every crash point of a document move, in the order a move passes them."""

Collections = list[tuple[str, str]]
"""(collection, key field) pairs a briefcase's documents live in."""


def _collections(dtypes: list[type[DocumentBriefcaseType]]) -> Collections:
    """Every collection of ``dtypes`` with its key field, plus the hot-data collections of each key."""
    out: dict[tuple[str, str], None] = {}
    for dtype in dtypes:
        for coll in [*dtype.collections, COUNTERS, STATS_LOCK]:
            out[(coll, dtype.key)] = None
    return list(out)


def _name(coll: str, key: str, pairs: Collections) -> str:
    """A collection's name in results; qualified by its key only where two types share it with different keys."""
    return coll if sum(1 for c, _ in pairs if c == coll) == 1 else f"{coll}[{key}]"


def _checksums(db: Any, pairs: Collections, gdid: GDID, session: Any = None) -> dict[str, tuple[int, str]]:
    import bson  # late: pymongo (bson's package) is an optional dependency

    out: dict[str, tuple[int, str]] = {}
    for coll, key in pairs:
        docs = list(db[coll].find({key: bytes(gdid)}, session=session))
        encoded = sorted((bson.encode({"k": d["_id"]}), bson.encode(d)) for d in docs)
        digest = hashlib.sha256()
        for _, body in encoded:
            digest.update(len(body).to_bytes(4, "big"))
            digest.update(body)
        out[_name(coll, key, pairs)] = (len(docs), digest.hexdigest())
    return out


def checksums(db: Any, dtype: type[DocumentBriefcaseType], gdid: GDID, session: Any = None) -> dict[str, tuple[int, str]]:
    """collection -> (document count, SHA-256 of the canonical BSON of its documents in ``_id`` order)."""
    return _checksums(db, _collections([dtype]), gdid, session)


def _txn(mongo: MongoStore, server: str) -> Any:
    """A started session, in a transaction where the server supports one."""
    session = mongo.clients.client(server).start_session()
    if mongo.clients.transactions(server):
        session.start_transaction()
    return session


def _end(session: Any, *, commit: bool) -> None:
    """Commit (or abort) the session's transaction, if it has one, and end the session."""
    try:
        if session.in_transaction:
            if commit:
                session.commit_transaction()
            else:
                session.abort_transaction()
    finally:
        session.end_session()


def _finish(session: Any) -> None:
    _end(session, commit=True)


def _abort(session: Any) -> None:
    _end(session, commit=False)


def _sess(session: Any) -> Any:
    return session if session.in_transaction else None


class _SourceChanged(MdbError):
    """Internal: the source's documents changed under the lock (the commit point rolls back)."""


@register_move
class DocumentMove(Move):
    """A document briefcase's move between two MongoDB servers (see the module docstring)."""

    server_kind: ClassVar[str] = MONGO
    journal_kind: ClassVar[str] = KIND
    after_journal_start: ClassVar[str] = "mongo.move.after_journal_start"
    after_commit_point: ClassVar[str] = "mongo.move.after_commit_point"

    def __init__(self, cluster: Cluster, area: str, gdid: GDID, target: str, options: MoveOptions, journal: Journal | None = None) -> None:
        self.mongo = documents_of(cluster)
        self.dtypes = self.mongo.types_of(area)
        if not self.dtypes:
            raise RoutingError(f"no document type of area {area!r} is registered with this cluster")
        self.pairs = _collections(self.dtypes)
        super().__init__(cluster, area, gdid, target, options, journal)
        self.previous: dict[str, Any] | None = None
        self.expected: dict[str, tuple[int, str]] = {}

    def id_prefix(self) -> str:
        return "mmove"

    def journal_entry(self) -> JournalEntry:
        return JournalEntry(
            move_id=self.move_id, kind=KIND, area=self.area, step="precheck", status=RUNNING, gdid=self.gdid,
            source=self.source, target=self.target, reshard_id=self.options.reshard_id, briefcases_total=1,
            params={"types": [f"{t.__module__}.{t.__qualname__}" for t in self.dtypes],
                    "default": self.cluster.router.default_placement(self.area, self.gdid).server,
                    "max_pause": self.options.max_pause, "reverse_of": self.options.reverse_of},
        )

    def _counts(self, server: str) -> dict[str, tuple[int, int]]:
        db = self.mongo.database(server)
        return {_name(c, k, self.pairs): (db[c].count_documents({k: bytes(self.gdid)}), 0) for c, k in self.pairs}

    def prepare(self) -> MoveResult | None:
        if self.options.reshard_id is None:
            refuse_if_busy(self.cluster, self.journal, self.area, self.gdid)
        sizes = self._counts(self.source)
        if self.options.on_sizes is not None:
            self.options.on_sizes(sizes)
        if self.options.dry_run:
            self.precheck()
            self.moved = sizes
            return self.result("dry-run")
        return None

    def precheck(self) -> None:
        state = self.mongo.database(self.target)[STATE].find_one({"_id": state_id(self.area, self.gdid)})
        if state is not None and state.get("state") != STATE_GONE:
            if state.get("state") == STATE_INCOMING:
                raise MdbError(f"{self.what}: move {state.get('move_id')!r} into {self.target!r} is unfinished (run `mdb moves resume MAP`)")
            raise RoutingError(f"{self.what}: target {self.target!r} already records it as {state.get('state')!r}")
        self.previous = {k: v for k, v in (state or {}).items() if k != "_id"} or None  # a fence from an earlier move away
        src_state = self.mongo.database(self.source)[STATE].find_one({"_id": state_id(self.area, self.gdid)})
        if src_state is not None and src_state.get("state") in (STATE_GONE, STATE_INCOMING):
            raise MdbError(f"{self.what}: the source records the briefcase as {src_state.get('state')!r}; run `mdb where` / `mdb moves resume`")

    def lock(self) -> None:
        self.journal.step(self.move_id, "lock")
        session = _txn(self.mongo, self.source)
        try:
            set_guard(self.mongo.database(self.source), self.area, self.gdid, self.move_id, _sess(session))
            _finish(session)
        except BaseException:
            _abort(session)
            raise
        fault_point("mongo.move.after_lock")

    def copy(self) -> None:
        self.journal.step(self.move_id, "copy")
        src, tgt, gid = self.mongo.database(self.source), self.mongo.database(self.target), self.gdid
        tgt[STATE].replace_one(
            {"_id": state_id(self.area, gid)},
            {"area": self.area, "gdid": bytes(gid), "state": STATE_INCOMING, "peer": self.source, "move_id": self.move_id,
             "previous": self.previous},
            upsert=True,
        )
        session = _txn(self.mongo, self.target)
        counts: dict[str, int] = {}
        try:
            for coll, key in self.pairs:
                docs = list(src[coll].find({key: bytes(gid)}))
                tgt[coll].delete_many({key: bytes(gid)}, session=_sess(session))  # a crashed attempt's leftovers
                if docs:
                    tgt[coll].insert_many(docs, session=_sess(session))
                counts[_name(coll, key, self.pairs)] = len(docs)
                if self.options.on_table is not None:
                    self.options.on_table(_name(coll, key, self.pairs), len(docs))
            _finish(session)
        except BaseException:
            _abort(session)
            raise
        self.moved = {name: (n, 0) for name, n in counts.items()}
        self.journal.update(self.move_id, tables={c: [n, n] for c, n in counts.items()}, rows_total=sum(counts.values()),
                            rows_done=sum(counts.values()), step="verify")
        fault_point("mongo.move.after_copy")

    def verify(self) -> None:
        self.expected = _checksums(self.mongo.database(self.target), self.pairs, self.gdid)
        if _checksums(self.mongo.database(self.source), self.pairs, self.gdid) != self.expected:
            telemetry.move_verification_failed(self.area)
            raise self.abort("verification failed: the target copy differs from the source")
        fault_point("mongo.move.after_verify")

    def commit_point(self) -> None:
        self.journal.step(self.move_id, "commit_point")
        src = self.mongo.database(self.source)
        session = _txn(self.mongo, self.source)
        try:
            if session.in_transaction and _checksums(src, self.pairs, self.gdid, session) != self.expected:
                raise _SourceChanged("the source changed under the lock")
            src[STATE].replace_one(
                {"_id": state_id(self.area, self.gdid)},
                {"area": self.area, "gdid": bytes(self.gdid), "state": STATE_GONE, "peer": self.target, "move_id": self.move_id},
                upsert=True, session=_sess(session),
            )
            fault_point("mongo.move.after_fence")
            _delete_source(src, self.area, self.pairs, self.gdid, _sess(session))
            _finish(session)
        except _SourceChanged as exc:
            _abort(session)
            raise self.abort(str(exc)) from None
        except BaseException:
            _abort(session)
            raise

    def finalize(self) -> None:
        _finalize(self.cluster, self.journal, self.area, self.gdid, self.source, self.target, self.move_id)

    def roll_back(self, why: str) -> None:
        _roll_back(self.mongo, self.journal, self.area, self.pairs, self.gdid, self.target, self.source, self.move_id, why)
        telemetry.move_aborted(self.area, self.options.reshard_id)

    @classmethod
    def resume(cls, cluster: Cluster, journal: Journal, entry: JournalEntry, *, retry: bool = False) -> ResumeOutcome:
        """The fence on the source decides (not the journal step): this move's fence there means finish."""
        assert entry.gdid is not None and entry.source is not None and entry.target is not None
        mongo = documents_of(cluster)
        pairs = _collections(mongo.types_of(entry.area))
        if not pairs:
            raise RoutingError(f"move {entry.move_id}: no document type of area {entry.area!r} is registered with this cluster")
        src = mongo.database(entry.source)
        fence = src[STATE].find_one({"_id": state_id(entry.area, entry.gdid)})
        if fence is not None and fence.get("state") == STATE_GONE and fence.get("move_id") == entry.move_id:
            _delete_source(src, entry.area, pairs, entry.gdid, None)
            _finalize(cluster, journal, entry.area, entry.gdid, entry.source, entry.target, entry.move_id)
            return ResumeOutcome(entry.move_id, KIND, "finalized", f"commit point had passed (step {entry.step!r})")
        _roll_back(mongo, journal, entry.area, pairs, entry.gdid, entry.target, entry.source, entry.move_id,
                   f"interrupted at step {entry.step!r}; rolled back")
        cluster.refresh()
        if retry and entry.reshard_id is None:
            options = MoveOptions(max_pause=float(entry.params.get("max_pause", 5.0)))
            result = cls(cluster, entry.area, entry.gdid, entry.target, options).run()
            return ResumeOutcome(entry.move_id, KIND, "retried", f"rolled back, then moved again as {result.move_id}")
        return ResumeOutcome(entry.move_id, KIND, "rolled back",
                             f"interrupted at step {entry.step!r}; source {entry.source!r} is authoritative")


def _delete_source(src: Any, area: str, pairs: Collections, gid: GDID, session: Any) -> None:
    for coll, key in pairs:
        src[coll].delete_many({key: bytes(gid)}, session=session)
    src[GUARD].delete_many({"_id": {"$in": guard_ids(area, gid)}}, session=session)


def _finalize(cluster: Cluster, journal: Journal, area: str, gid: GDID, source: str, target: str, move_id: str) -> None:
    """After the commit point: directory, target state, journal done. Idempotent."""
    mongo = documents_of(cluster)
    journal.step(move_id, "relocation")
    default = cluster.router.default_placement(area, gid).server
    set_relocation(cluster, area, gid, None if target == default else target)
    fault_point("mongo.move.after_relocation")
    journal.step(move_id, "target_state")
    tgt = mongo.database(target)
    if target == default:
        tgt[STATE].delete_one({"_id": state_id(area, gid)})
    else:
        tgt[STATE].replace_one(
            {"_id": state_id(area, gid)},
            {"area": area, "gdid": bytes(gid), "state": STATE_RESIDENT, "peer": source, "move_id": move_id},
            upsert=True,
        )
    fault_point("mongo.move.after_target_state")
    journal.finish(move_id, DONE, briefcases_done=1)
    cluster.refresh()


def _roll_back(mongo: MongoStore, journal: Journal, area: str, pairs: Collections, gid: GDID, target: str, source: str, move_id: str, why: str) -> None:
    """Before the commit point: discard the target copy, unlock the source; the source stays authoritative."""
    tgt, src = mongo.database(target), mongo.database(source)
    state = tgt[STATE].find_one({"_id": state_id(area, gid)})
    for coll, key in pairs:
        tgt[coll].delete_many({key: bytes(gid)})
    if state is not None and state.get("move_id") == move_id and state.get("state") == STATE_INCOMING:
        if state.get("previous"):  # give back the fence of an earlier move away: stale routers still need it
            tgt[STATE].replace_one({"_id": state_id(area, gid)}, state["previous"])
        else:
            tgt[STATE].delete_one({"_id": state_id(area, gid)})
    set_guard(src, area, gid, None)
    journal.finish(move_id, ROLLED_BACK, detail=why)


@register_scan
class DocumentPartitionScan(PartitionScan):
    """MongoDB servers: a reshard's plan reads the partition's briefcases here.

    Keys are streamed from each type's root collection (projected to the key, sorted by it),
    the movers' documents counted per collection of :func:`_collections` (the hot-data ones
    included, as a move carries them). Incoming copies and fenced leftovers are not the
    server's: left out.
    """

    server_kind: ClassVar[str] = MONGO

    def __init__(self, cluster: Cluster, area: str) -> None:
        super().__init__(cluster, area)
        self.mongo = documents_of(cluster)
        self.dtypes = self.mongo.types_of(area)
        if not self.dtypes:
            raise RoutingError(f"no document type of area {area!r} is registered with this cluster")
        self.pairs = _collections(self.dtypes)

    @property
    def units(self) -> list[str]:
        return [_name(c, k, self.pairs) for c, k in self.pairs]

    @contextmanager
    def reading(self, server: str) -> Iterator[ServerScan]:
        yield _DocumentServerScan(server, self.mongo.database(server), self.area, self.dtypes, self.pairs)

    def check_servers(self, servers: Iterable[str], what: str) -> None:
        for server in dict.fromkeys(servers):
            try:
                self.mongo.database(server).list_collection_names()
            except Exception as exc:  # the driver's error as mdb's, naming the server (or raised as it is)
                translated = self.mongo.translate(server, exc)
                if translated is None:
                    raise
                raise MdbError(f"{what}: {translated}") from exc


class _DocumentServerScan(ServerScan):
    """A MongoDB server's side of a plan: plain reads of its database (no transaction spans a plan's reads)."""

    def __init__(self, server: str, db: Any, area: str, dtypes: list[type[DocumentBriefcaseType]], pairs: Collections) -> None:
        super().__init__(server)
        self.db = db
        self.area = area
        self.dtypes = dtypes
        self.pairs = pairs

    def keys(self, in_partition: Callable[[GDID], bool]) -> Iterator[GDID]:
        """Each type's root keys in key order, merged; a briefcase with roots of two types once."""
        skip = set(excluded_gdids(self.db, self.area))

        def roots(dtype: type[DocumentBriefcaseType]) -> Iterator[bytes]:
            for doc in self.db[dtype.root].find({dtype.key: {"$exists": True}}, {dtype.key: 1, "_id": 0}, sort=[(dtype.key, 1)]):
                yield bytes(doc[dtype.key])

        last: bytes | None = None
        for key in heapq.merge(*(roots(dtype) for dtype in self.dtypes)):
            if key == last or key in skip:
                continue
            last = key
            gid = GDID.from_bytes(key)
            if in_partition(gid):
                yield gid

    def rows(self, gdids: Sequence[GDID]) -> list[dict[str, int]]:
        """One aggregation per collection: the documents of ``gdids`` grouped by key."""
        position = {bytes(g): i for i, g in enumerate(gdids)}
        out: list[dict[str, int]] = [{} for _ in gdids]
        for coll, key in self.pairs:
            name = _name(coll, key, self.pairs)
            for doc in self.db[coll].aggregate([{"$match": {key: {"$in": list(position)}}}, {"$group": {"_id": f"${key}", "n": {"$sum": 1}}}]):
                out[position[bytes(doc["_id"])]][name] = int(doc["n"])
        return out


def move_documents(cluster: Cluster, dtype: type[DocumentBriefcaseType], gdid: GDID | str, target: str) -> MoveResult:
    """Move one document briefcase (every type of ``dtype``'s area) to ``target``; see the module docstring."""
    gid = gdid if isinstance(gdid, GDID) else GDID.parse(gdid)
    cluster.refresh()
    return DocumentMove(cluster, dtype.area, gid, target, MoveOptions()).run()
