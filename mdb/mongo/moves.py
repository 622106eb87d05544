"""Moving a document briefcase between MongoDB shards: the SQL protocol (DESIGN invariant 3) on documents.

Steps, each recorded in the same move journal as SQL moves (:class:`mdb.moves.journal.Journal`,
kind ``mongo-move``; ``mdb moves`` lists them, :func:`resume_mongo_moves` resolves them):

1. lock: every guard slot of the briefcase on the source gets ``locked_by = move id``; new
   write sessions wait, a write session still in flight conflicts with the lock (transactional
   servers) so it either committed before the lock or is retried after it;
2. copy: the target records the briefcase as ``incoming`` (sessions and fan-outs ignore the
   copy), then receives every document of every collection of the type plus its counter and
   stats-lock documents, in one transaction where the target supports it;
3. verify: document count and a SHA-256 of the documents (canonical BSON, ordered by ``_id``)
   per collection, computed on each side separately;
4. commit point: on the source, the fence (``gone``, peer = target) and the deletion of the
   source documents. With transactions it is one transaction that re-verifies the source
   first; without, the fence is written first (that single-document write is the commit
   point) and the deletions follow, finished by resume after a crash;
5. finalize: relocation directory entry (or its removal when the target is the default
   shard), target state ``resident`` (or none on the default shard), journal done.

A crash before the commit point leaves the source authoritative (resume discards the target
copy and unlocks); after it, resume finishes steps 4-5. Crash points are named
(:data:`HOOK_POINTS`); tests make them raise in-process (the fake server lives in the test's
process, so it cannot be SIGKILLed separately; the SQL move tests use real SIGKILL).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from mdb.errors import MdbError, RoutingError
from mdb.gdid import GDID
from mdb.moves.journal import DONE, ROLLED_BACK, RUNNING, Journal, JournalEntry, new_move_id
from mdb.mongo.hot import COUNTERS, STATS_LOCK
from mdb.mongo.shard_state import GUARD, STATE, guard_ids, set_guard, state_id
from mdb.mongo.types import DocumentBriefcaseType
from mdb.router import Router
from mdb.system_tables import STATE_GONE, STATE_INCOMING, STATE_RESIDENT

if TYPE_CHECKING:
    from mdb.store import Store

__all__ = ["HOOK_POINTS", "KIND", "MoveVerificationError", "checksums", "move_documents", "resume_mongo_moves"]

KIND: Final = "mongo-move"
HOOK_POINTS: Final = (
    "mongo.move.after_journal_start",
    "mongo.move.after_lock",
    "mongo.move.after_copy",
    "mongo.move.after_verify",
    "mongo.move.after_fence",
    "mongo.move.after_commit_point",
    "mongo.move.after_relocation",
    "mongo.move.after_target_state",
)

hook: Callable[[str], None] | None = None
"""Tests set this to raise at a named point (an in-process stand-in for a crash)."""


def _point(name: str) -> None:
    if hook is not None:
        hook(name)


class MoveVerificationError(MdbError):
    """The target copy differs from the source: the move was rolled back, nothing was lost."""


@dataclass
class MongoMoveResult:
    move_id: str
    source: str
    target: str
    documents: dict[str, int]


def _collections(dtype: type[DocumentBriefcaseType]) -> list[str]:
    return [*dtype.collections, COUNTERS, STATS_LOCK]


def checksums(db: Any, dtype: type[DocumentBriefcaseType], gdid: GDID, session: Any = None) -> dict[str, tuple[int, str]]:
    """collection -> (document count, SHA-256 of the canonical BSON of its documents in ``_id`` order)."""
    import bson

    out: dict[str, tuple[int, str]] = {}
    for coll in _collections(dtype):
        docs = list(db[coll].find({dtype.key: bytes(gdid)}, session=session))
        encoded = sorted((bson.encode({"k": d["_id"]}), bson.encode(d)) for d in docs)
        digest = hashlib.sha256()
        for _, body in encoded:
            digest.update(len(body).to_bytes(4, "big"))
            digest.update(body)
        out[coll] = (len(docs), digest.hexdigest())
    return out


def _txn(mongo: Any, server: str) -> Any:
    """A started session, in a transaction where the server supports one."""
    session = mongo.clients.client(server).start_session()
    if mongo.clients.transactions(server):
        session.start_transaction()
    return session


def _finish(session: Any) -> None:
    try:
        if session.in_transaction:
            session.commit_transaction()
    finally:
        session.end_session()


def _abort(session: Any) -> None:
    try:
        if session.in_transaction:
            session.abort_transaction()
    finally:
        session.end_session()


def _sess(session: Any) -> Any:
    return session if session.in_transaction else None


def move_documents(
    store: Store, dtype: type[DocumentBriefcaseType], gdid: GDID | str, target: str, *, move_id: str | None = None
) -> MongoMoveResult:
    """Move one document briefcase to ``target`` (see the module docstring for the protocol)."""
    gid = gdid if isinstance(gdid, GDID) else GDID.parse(gdid)
    mongo = store.mongo
    store.refresh()
    placement = store.router.locate(dtype.area, gid)
    source = placement.server
    for role, server in (("source", source), ("target", target)):
        if not mongo.clients.is_mongo(server):
            raise RoutingError(f"move of {dtype.area}/{gid}: {role} server {server!r} is not a MongoDB server")
    if source == target:
        raise RoutingError(f"move of {dtype.area}/{gid}: it already lives on {target!r}")
    src, tgt = mongo.database(source), mongo.database(target)
    state = tgt[STATE].find_one({"_id": state_id(dtype.area, gid)})
    if state is not None and state.get("state") not in (STATE_GONE,):
        raise RoutingError(f"move of {dtype.area}/{gid}: target {target!r} already records it as {state.get('state')!r}")
    journal = Journal(store)
    move_id = move_id or new_move_id("mmove")
    journal.start(JournalEntry(
        move_id=move_id, kind=KIND, area=dtype.area, step="lock", status=RUNNING, gdid=gid, source=source,
        target=target, params={"type": f"{dtype.__module__}.{dtype.__qualname__}", "default": placement.default_server},
    ))
    _point("mongo.move.after_journal_start")
    session = _txn(mongo, source)
    try:
        set_guard(src, dtype.area, gid, move_id, _sess(session))
        _finish(session)
    except BaseException:
        _abort(session)
        raise
    _point("mongo.move.after_lock")
    journal.step(move_id, "copy")
    previous = {k: v for k, v in (state or {}).items() if k != "_id"} or None  # a fence from an earlier move away
    tgt[STATE].replace_one(
        {"_id": state_id(dtype.area, gid)},
        {"area": dtype.area, "gdid": bytes(gid), "state": STATE_INCOMING, "peer": source, "move_id": move_id,
         "previous": previous},
        upsert=True,
    )
    session = _txn(mongo, target)
    counts: dict[str, int] = {}
    try:
        for coll in _collections(dtype):
            docs = list(src[coll].find({dtype.key: bytes(gid)}))
            tgt[coll].delete_many({dtype.key: bytes(gid)}, session=_sess(session))  # a crashed attempt's leftovers
            if docs:
                tgt[coll].insert_many(docs, session=_sess(session))
            counts[coll] = len(docs)
        _finish(session)
    except BaseException:
        _abort(session)
        raise
    journal.update(move_id, tables={c: [n, n] for c, n in counts.items()}, rows_total=sum(counts.values()),
                   rows_done=sum(counts.values()), step="verify")
    _point("mongo.move.after_copy")
    expected = checksums(tgt, dtype, gid)
    if checksums(src, dtype, gid) != expected:
        _roll_back(store, journal, dtype, gid, source, target, move_id, "verification failed: target differs from source")
        raise MoveVerificationError(f"move {move_id} of {dtype.area}/{gid}: target copy differs from the source; rolled back")
    _point("mongo.move.after_verify")
    journal.step(move_id, "commit point")
    session = _txn(mongo, source)
    try:
        if session.in_transaction and checksums(src, dtype, gid, session) != expected:
            raise MoveVerificationError(f"move {move_id}: the source changed under the lock")
        src[STATE].replace_one(
            {"_id": state_id(dtype.area, gid)},
            {"area": dtype.area, "gdid": bytes(gid), "state": STATE_GONE, "peer": target, "move_id": move_id},
            upsert=True, session=_sess(session),
        )
        _point("mongo.move.after_fence")
        _delete_source(src, dtype, gid, _sess(session))
        _finish(session)
    except MoveVerificationError:
        _abort(session)
        _roll_back(store, journal, dtype, gid, source, target, move_id, "the source changed under the lock")
        raise
    except BaseException:
        _abort(session)
        raise
    _point("mongo.move.after_commit_point")
    _finalize(store, journal, dtype, gid, source, target, move_id)
    return MongoMoveResult(move_id, source, target, counts)


def _delete_source(src: Any, dtype: type[DocumentBriefcaseType], gid: GDID, session: Any) -> None:
    for coll in _collections(dtype):
        src[coll].delete_many({dtype.key: bytes(gid)}, session=session)
    src[GUARD].delete_many({"_id": {"$in": guard_ids(dtype.area, gid)}}, session=session)


def _finalize(store: Store, journal: Journal, dtype: type[DocumentBriefcaseType], gid: GDID, source: str, target: str, move_id: str) -> None:
    mongo = store.mongo
    journal.step(move_id, "relocation")
    default = Router(store.map).locate(dtype.area, gid).default_server
    _set_relocation(store, dtype.area, gid, None if target == default else target)
    _point("mongo.move.after_relocation")
    journal.step(move_id, "target state")
    tgt = mongo.database(target)
    if target == default:
        tgt[STATE].delete_one({"_id": state_id(dtype.area, gid)})
    else:
        tgt[STATE].replace_one(
            {"_id": state_id(dtype.area, gid)},
            {"area": dtype.area, "gdid": bytes(gid), "state": STATE_RESIDENT, "peer": source, "move_id": move_id},
            upsert=True,
        )
    _point("mongo.move.after_target_state")
    journal.finish(move_id, DONE)
    store.refresh()


def _set_relocation(store: Store, area: str, gid: GDID, server: str | None) -> None:
    router = Router(store.map)
    if store._central_on_mongo(router):
        from mdb.mongo.central import clear_relocation_mongo, set_relocation_mongo

        if server is None:
            clear_relocation_mongo(store.mongo, area, gid)
        else:
            set_relocation_mongo(store.mongo, area, gid, server)
        return
    from mdb.relocations import clear_relocation, set_relocation

    with store.transaction(router.locate_central(gid).server) as conn:
        if server is None:
            clear_relocation(conn, area, gid)
        else:
            set_relocation(conn, area, gid, server)


def _roll_back(store: Store, journal: Journal, dtype: type[DocumentBriefcaseType], gid: GDID, source: str, target: str, move_id: str, why: str) -> None:
    """Before the commit point: discard the target copy, unlock the source; the source stays authoritative."""
    mongo = store.mongo
    tgt, src = mongo.database(target), mongo.database(source)
    for coll in _collections(dtype):
        tgt[coll].delete_many({dtype.key: bytes(gid)})
    state = tgt[STATE].find_one({"_id": state_id(dtype.area, gid)})
    if state is not None and state.get("move_id") == move_id and state.get("state") == STATE_INCOMING:
        if state.get("previous"):  # give back the fence of an earlier move away: stale routers still need it
            tgt[STATE].replace_one({"_id": state_id(dtype.area, gid)}, state["previous"])
        else:
            tgt[STATE].delete_one({"_id": state_id(dtype.area, gid)})
    set_guard(src, dtype.area, gid, None)
    journal.finish(move_id, ROLLED_BACK, detail=why)


def resume_mongo_moves(store: Store, dtype_of: Callable[[str], type[DocumentBriefcaseType]] | None = None) -> list[tuple[str, str]]:
    """Resolve every unfinished document move: finish it past its commit point, roll it back before.

    Returns (move id, what was done). The fence on the source is the authority, not the journal step.
    """
    mongo = store.mongo
    journal = Journal(store)
    by_name = {f"{t.__module__}.{t.__qualname__}": t for t in mongo.types}
    done: list[tuple[str, str]] = []
    for entry in journal.entries(unfinished=True):
        if entry.kind != KIND:
            continue
        assert entry.gdid is not None and entry.source is not None and entry.target is not None
        name = entry.params.get("type", "")
        dtype = dtype_of(name) if dtype_of else by_name.get(name)
        if dtype is None:
            raise RoutingError(f"move {entry.move_id}: document type {name!r} is not registered with this Store")
        src = mongo.database(entry.source)
        fence = src[STATE].find_one({"_id": state_id(dtype.area, entry.gdid)})
        passed = fence is not None and fence.get("state") == STATE_GONE and fence.get("move_id") == entry.move_id
        if passed:
            _delete_source(src, dtype, entry.gdid, None)
            _finalize(store, journal, dtype, entry.gdid, entry.source, entry.target, entry.move_id)
            done.append((entry.move_id, "finished (past the commit point)"))
        else:
            _roll_back(store, journal, dtype, entry.gdid, entry.source, entry.target, entry.move_id, f"resumed at step {entry.step!r}: rolled back")
            done.append((entry.move_id, "rolled back (before the commit point)"))
    store.refresh()
    return done
