"""``mdb fsck``: what lies on an area's shards that the routing does not explain, and which of it is safe to remove.

Every server that can hold the area's briefcases (layout, relocation targets, and every other
server of the map with the area's tables: spares, servers a reshard took out) is scanned twice through its
backend's :class:`~mdb.backends.base.AreaScan`, both streamed: its briefcase keys and its state
rows (SQL tables or MongoDB collections alike; comparing and removing copies is per kind,
:class:`_Copies`: per-row checksums and the SQL move lock, or per-collection BSON checksums and
the document guard). Each briefcase is
routed with ``store.router`` (map + relocation directory); one whose rows sit on a server the
router does not send it to is a *suspect*, examined afterwards (suspects are few; the keys of a
shard are never held in memory). Findings:

- ``unfinished_move``: rows or state rows of a briefcase that a running or interrupted move,
  or a reshard's batch, names in the journal (:mod:`mdb.fleet.inflight`). Never touched, also
  not when the move starts while fsck runs (read again under the lock before anything is
  deleted): ``mdb moves resume MAP`` resolves it.
- ``leftover_copy``: rows on a server the briefcase is not routed to, every one of them equal
  (per-row checksum, :func:`mdb.moves.verify.row_digests`) to the row the owner holds: a copy
  left by a failed move. ``--repair`` deletes them on that server under the briefcase's write
  lock (:func:`mdb.moves.move.locked_source`), checking again under the lock first.
- ``misplaced``: rows on a server the briefcase is not routed to that the owner lacks or holds
  differently: possibly the only copy, so never deleted; a person decides.
- ``stale_fence``: a fence (``gone``) on the very server the router sends the briefcase to: its
  sessions are refused there. Repaired (the state row only) when that server holds the
  briefcase and the fence's peer holds no row of it; otherwise reported.
- ``stale_incoming`` / ``stale_freeze``: an ``incoming`` row or freeze marker no unfinished
  move or reshard explains. Reported; an ``incoming`` row goes with its leftover copy.
- ``stale_apply_marker``: the marker of a ``mdb map apply`` that stopped before it published
  its map (:func:`mdb.ownership.applying_mark`). It turns no session away; repaired (removed).
- ``orphan_relocation``: a relocation directory entry (CENTRAL) sending a briefcase to a server
  that holds no row of it (checked during the same scan). Reported only.
- ``central_<kind>``: CENTRAL index entries out of step (:func:`mdb.central.reconcile.check`,
  e.g. ``dangling``: an entry pointing at no briefcase). ``mdb central repair MAP`` fixes them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete
from sqlalchemy.engine import Connection

from mdb.backends import backend_of
from mdb.backends.base import AreaData, BriefcaseStateRow, documents_of
from mdb.central.indexes import CentralIndex, registered_indexes
from mdb.central.reconcile import check as central_check
from mdb.fleet.inflight import InFlight, in_flight
from mdb.fleet.scan import area_data, area_servers, document_types, scan_of
from mdb.gdid import GDID
from mdb.mongo.hot import COUNTERS, STATS_LOCK
from mdb.moves.document_move import checksums
from mdb.mongo.shard_state import GUARD, STATE, guard_ids, set_guard, state_id
from mdb.moves import verify
from mdb.moves.copy import AreaTable, delete_rows, measure
from mdb.moves.move import DEFAULT_LOCK_WAIT, DEFAULT_MAX_PAUSE, area_tables, locked_source
from mdb.ownership import APPLYING_PREFIX, freeze_holder
from mdb.system_tables import STATE_FROZEN, STATE_GONE, STATE_INCOMING, briefcase_state

__all__ = ["Finding", "FsckReport", "fsck"]

RESUME = "run `mdb moves resume MAP`"


@dataclass
class Finding:
    kind: str
    server: str
    gdid: GDID | None
    detail: str
    action: str = "reported"
    """reported | repaired | a hint (what to run)."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "server": self.server, "gdid": None if self.gdid is None else str(self.gdid),
                "detail": self.detail, "action": self.action}


@dataclass
class FsckReport:
    area: str
    servers: list[str]
    briefcases: int = 0
    findings: list[Finding] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    central_indexes: list[str] = field(default_factory=list)
    """The CENTRAL indexes of the area that were checked (none declared: CENTRAL was not checked)."""

    @property
    def clean(self) -> bool:
        return not self.findings

    @property
    def problems_left(self) -> list[Finding]:
        return [f for f in self.findings if f.action != "repaired"]

    def to_json(self) -> dict[str, Any]:
        return {"area": self.area, "servers": self.servers, "briefcases": self.briefcases, "clean": self.clean,
                "findings": [f.to_json() for f in self.findings], "not_checked": self.not_checked,
                "central_indexes": self.central_indexes}


def _foreign_rows(store: Any, owner: str, tables: Sequence[AreaTable], gdid: GDID, here: Connection) -> int:
    """Rows of ``gdid`` on ``server`` (read on ``here``) that the owner lacks or holds differently."""
    with store.transaction(owner) as there:
        method = verify.method_for(here, there)
        differing = 0
        for at in tables:
            mine = verify.row_digests(here, at, gdid, method)
            if mine:
                theirs = verify.row_digests(there, at, gdid, method)
                differing += sum(1 for key, digest in mine.items() if theirs.get(key) != digest)
    return differing


def _resident_or_incoming(conn: Connection, area: str, gdid: GDID) -> None:
    conn.execute(delete(briefcase_state).where(
        briefcase_state.c.area == area, briefcase_state.c.gdid == gdid, briefcase_state.c.state != STATE_GONE))


def _remove_copy(store: Any, area: str, server: str, owner: str, gdid: GDID, tables: Sequence[AreaTable]) -> int | str:
    """Delete a verified leftover copy on ``server``: checked again under the briefcase's write lock there.

    Inside the deleting transaction, with the lock held, the journal is read again: a move or
    batch that started since the scan names the briefcase before it copies anything (its
    journal row commits first), so a copy it makes is never taken for a leftover. Returns the
    rows deleted, or why nothing was (the check under the lock no longer holds).
    """
    with locked_source(store, server, area, gdid, lock_wait=DEFAULT_LOCK_WAIT, max_pause=DEFAULT_MAX_PAUSE) as (conn, _):
        store.refresh()
        named = in_flight(store, area).naming(gdid)
        if named:
            return f"move {', '.join(named)} names it now"
        if store.router.locate(area, gdid).server == server:
            return "it is routed here now"
        if _foreign_rows(store, owner, tables, gdid, conn):
            return "it differs from the owner's copy now"
        deleted = sum(delete_rows(conn, tables, gdid).values())
        _resident_or_incoming(conn, area, gdid)  # its incoming/resident row goes with the copy; a fence stays
        conn.commit()
        return deleted


@dataclass(frozen=True)
class _Copies:
    """How one server's kind compares a briefcase's data with the owner's copy and removes a verified leftover."""

    noun: str
    """rows | documents"""
    differ: Callable[[str, GDID], str]
    """(owner, gdid) -> what the owner lacks or holds differently, "" when the data here is a copy of the owner's."""
    remove: Callable[[str, GDID], int | str]
    """(owner, gdid) -> how much was deleted, or why nothing was (the check under the lock no longer holds)."""


def _sql_copies(store: Any, area: str, server: str, tables: Sequence[AreaTable]) -> _Copies:
    def differ(owner: str, gdid: GDID) -> str:
        with store.transaction(server) as here:
            n = _foreign_rows(store, owner, tables, gdid, here)
        return f"{n} row(s)" if n else ""

    return _Copies("rows", differ, lambda owner, gdid: _remove_copy(store, area, server, owner, gdid, tables))


def _examine(store: Any, area: str, server: str, gdid: GDID, copies: _Copies, unfinished: InFlight, repair: bool) -> Finding:
    """A briefcase with data on a server it is not routed to: unfinished move, leftover copy or misplaced."""
    if gdid in unfinished.briefcases:
        ids = ", ".join(unfinished.naming(gdid))
        return Finding("unfinished_move", server, gdid, f"{copies.noun} of a briefcase whose move {ids} is unfinished", RESUME)
    owner = store.router.locate(area, gdid).server
    differing = copies.differ(owner, gdid)
    if differing:
        return Finding("misplaced", server, gdid, f"{differing} that {owner!r}, where the briefcase is routed, lacks "
                       "or holds differently; not removed (it may be the only copy)")
    detail = f"a copy of {copies.noun} {owner!r} holds (the briefcase is routed there)"
    if not repair:
        return Finding("leftover_copy", server, gdid, detail)
    deleted = copies.remove(owner, gdid)
    if isinstance(deleted, str):
        return Finding("leftover_copy", server, gdid, f"{detail}; changed while repairing ({deleted}), left as it is "
                       "(run fsck again)")
    return Finding("leftover_copy", server, gdid, f"{detail}; deleted {deleted} {copies.noun[:-1]}(s) here", "repaired")


def _central(store: Any, indexes: list[type[CentralIndex]]) -> list[Finding]:
    """CENTRAL index problems of the area's declared indexes (the one check `mdb central check` runs)."""
    if not indexes:
        return []
    found = central_check(store.central, indexes)
    return [
        Finding(f"central_{p.kind}", store.router.locate_central(p.key).server, p.gdid,
                f"index {p.index!r} key {p.key!r}: {p.detail}", "run `mdb central repair MAP`")
        for p in found.problems
    ]


def _odd_state(store: Any, area: str, server: str, state: BriefcaseStateRow, unfinished: InFlight) -> bool:
    """A state row the routing and the journal do not explain (a fence on a server moved away from is normal)."""
    if state.state == STATE_FROZEN:
        return freeze_holder(state.move_id or "") not in unfinished.reshards
    if state.state == STATE_INCOMING:
        return state.move_id not in unfinished.moves
    here = store.router.locate(area, state.gdid).server == server
    return here if state.state == STATE_GONE else not here


def _state_finding(store: Any, area: str, server: str, state: BriefcaseStateRow, data: AreaData, unfinished: InFlight) -> tuple[Finding, bool]:
    """What an odd state row is, and whether removing it is provably safe (a fence whose peer holds nothing)."""
    gdid, peer = state.gdid, state.peer
    if state.state == STATE_FROZEN and (state.move_id or "").startswith(APPLYING_PREFIX):
        return Finding("stale_apply_marker", server, None, f"marker of map apply {freeze_holder(state.move_id or '')!r}, an apply "
                       "that stopped before it published its map: it turns no session away"), True
    if state.state == STATE_FROZEN:
        return Finding("stale_freeze", server, None, f"freeze marker of partition {peer} by {freeze_holder(state.move_id or '')!r}, which the journal "
                       "does not list as an unfinished reshard: writes of that partition wait; remove it by hand once sure no reshard runs"), False
    if state.state == STATE_INCOMING:
        return Finding("stale_incoming", server, gdid, f"'incoming' row of move {state.move_id!r}, which the journal "
                       "does not list as unfinished (removed with its copy when that copy is a verified leftover)"), False
    named = unfinished.naming(gdid)
    if named:
        return Finding("unfinished_move", server, gdid, f"{state.state!r} row of a briefcase whose move {', '.join(named)} "
                       "is unfinished", RESUME), False
    if state.state != STATE_GONE:
        return Finding("stale_resident", server, gdid, f"{state.state!r} row here, but the relocation directory routes the "
                       f"briefcase to {store.router.locate(area, gdid).server!r}"), False
    detail = f"fence (moved to {peer!r}, move {state.move_id!r}) on the server the briefcase is routed to: its sessions are refused"
    peer_rows = scan_of(store, peer, data).rows_of(gdid) if peer is not None and peer in store.map.servers else 0
    safe = gdid not in unfinished.briefcases and peer_rows == 0 and scan_of(store, server, data).rows_of(gdid) > 0
    if not safe:
        return Finding("stale_fence", server, gdid, detail + f"; not removed ({peer!r} holds {peer_rows} row(s) of it, or no row is here)"), False
    return Finding("stale_fence", server, gdid, detail + f"; the rows are here and {peer!r} holds none: --repair removes it"), True


def _repair_fence(store: Any, area: str, server: str, gdid: GDID, tables: Sequence[AreaTable], finding: Finding) -> Finding:
    """Remove a safe stale fence on a SQL server under the briefcase's write lock (checked again there)."""
    detail = finding.detail.split("; ")[0]
    with locked_source(store, server, area, gdid, lock_wait=DEFAULT_LOCK_WAIT, max_pause=DEFAULT_MAX_PAUSE) as (conn, _):
        # checked again under the lock: no move names it now, and its rows are here
        if in_flight(store, area).naming(gdid) or not sum(n for n, _ in measure(conn, tables, gdid, with_bytes=False).values()):
            return Finding("stale_fence", server, gdid, detail + "; changed while repairing, left as it is (run fsck again)")
        conn.execute(delete(briefcase_state).where(briefcase_state.c.area == area, briefcase_state.c.gdid == gdid,
                                                   briefcase_state.c.state == STATE_GONE))
        conn.commit()
    return Finding("stale_fence", server, gdid, detail + "; removed (the rows are here, the peer holds none)", "repaired")


def _document_collections(store: Any, area: str) -> list[tuple[str, str]]:
    """(collection, key field) of everything a document move carries: the types' collections, counters, stats locks."""
    out: list[tuple[str, str]] = []
    for dtype in document_types(store, area):
        out += [(name, dtype.key) for name in (*dtype.collections, COUNTERS, STATS_LOCK)]
    return list(dict.fromkeys(out))


def _documents_differ(store: Any, area: str, server: str, owner: str, gdid: GDID) -> list[str]:
    """Collections whose documents of ``gdid`` on ``server`` the owner lacks or holds differently (empty: a copy)."""
    if not backend_of(store.map, owner).holds_documents:
        return [f"the owner {owner!r} is not a MongoDB server"]
    mongo = documents_of(store)
    here, there = mongo.database(server), mongo.database(owner)
    differing: list[str] = []
    for dtype in document_types(store, area):
        mine, theirs = checksums(here, dtype, gdid), checksums(there, dtype, gdid)
        differing += [name for name, (count, digest) in mine.items() if count and theirs.get(name) != (count, digest)]
    return differing


@contextmanager
def _document_lock(store: Any, server: str, area: str, gdid: GDID) -> Iterator[Any]:
    """The briefcase's guard on ``server`` held by fsck (as a document move holds its source): writers there wait.

    On servers with transactions a write session in flight conflicts with the lock and is
    retried after it; on a standalone server one already past its guard check may still write
    (the same window document moves document). Yields the server's database; unlocked after.
    """
    db = documents_of(store).database(server)
    set_guard(db, area, gdid, f"fsck-{uuid.uuid4().hex[:12]}")
    try:
        yield db
    finally:
        set_guard(db, area, gdid, None)


def _remove_documents(store: Any, area: str, server: str, gdid: GDID) -> int | str:
    """Delete a verified leftover document copy on ``server``, checked again under the guard (a str: why not)."""
    with _document_lock(store, server, area, gdid) as db:
        store.refresh()
        named = in_flight(store, area).naming(gdid)
        if named:
            return f"move {', '.join(named)} names it now"
        if (store.router.locate(area, gdid).server == server
                or _documents_differ(store, area, server, store.router.locate(area, gdid).server, gdid)):
            return "it is routed here or differs from the owner's copy now"
        deleted = sum(int(db[name].delete_many({key: bytes(gdid)}).deleted_count) for name, key in _document_collections(store, area))
        # its incoming/resident record goes with the copy; a fence stays (stale routers still need it)
        db[STATE].delete_one({"_id": state_id(area, gdid), "state": {"$ne": STATE_GONE}})
    db[GUARD].delete_many({"_id": {"$in": guard_ids(area, gdid)}})  # no data of it here: its guard goes too
    return deleted


def _document_copies(store: Any, area: str, server: str) -> _Copies:
    """Documents are a copy when, per collection, count and SHA-256 of the canonical BSON equal the owner's
    (:func:`mdb.mongo.moves.checksums`, what document moves verify with); a leftover is deleted
    under the briefcase's guard there, checked again under it."""

    def differ(owner: str, gdid: GDID) -> str:
        found = _documents_differ(store, area, server, owner, gdid)
        return f"documents ({', '.join(found)})" if found else ""

    return _Copies("documents", differ, lambda owner, gdid: _remove_documents(store, area, server, gdid))


def _repair_document_fence(store: Any, area: str, server: str, state: BriefcaseStateRow, data: AreaData, finding: Finding) -> Finding:
    """Remove a safe stale fence on a MongoDB server under the briefcase's guard (checked again there)."""
    detail = finding.detail.split("; ")[0]
    scan = scan_of(store, server, data)
    with _document_lock(store, server, area, state.gdid) as db:
        peer = state.peer
        peer_rows = scan_of(store, peer, data).rows_of(state.gdid) if peer is not None and peer in store.map.servers else 0
        if peer_rows or not scan.rows_of(state.gdid) or in_flight(store, area).naming(state.gdid):
            return Finding("stale_fence", server, state.gdid, detail + "; changed while repairing, left as it is (run fsck again)")
        db[STATE].delete_one({"_id": state_id(area, state.gdid), "state": STATE_GONE, "move_id": state.move_id})
    return Finding("stale_fence", server, state.gdid, detail + "; removed (the documents are here, the peer holds none)", "repaired")


def fsck(store: Any, area: str, *, repair: bool = False) -> FsckReport:
    """Check (and with ``repair`` fix what is provably safe) every server of ``area`` and its CENTRAL entries.

    Every server is scanned through its backend (SQL and MongoDB alike); repairs take the
    briefcase's write lock of the server's kind (SQL: the move machinery's; MongoDB: its guard).
    """
    store.refresh()
    data = area_data(store, area)
    servers = area_servers(store, area, data)
    report = FsckReport(area, servers)
    tables = area_tables(store, area) if data.tables else []
    unfinished = in_flight(store, area)
    relocated: dict[str, set[GDID]] = {}  # server -> briefcases the directory sends there (already in the router)
    for (a, g), target in store.router.relocations.items():
        if a == area:
            relocated.setdefault(target, set()).add(g)
    stray: set[GDID] = set()  # briefcases with data off their routed server (the findings: few)
    for server in servers:
        sql = not backend_of(store.map, server).holds_documents
        scan = scan_of(store, server, data)
        copies = _sql_copies(store, area, server, tables) if sql else _document_copies(store, area, server)
        suspects: list[GDID] = []
        expected = relocated.get(server, set())
        for gdid in scan.keys():
            expected.discard(gdid)
            if store.router.locate(area, gdid).server != server:
                suspects.append(gdid)
            else:
                report.briefcases += 1  # counted once, where it is routed; a copy elsewhere is a finding
        stray.update(suspects)
        states = [s for s in scan.states() if _odd_state(store, area, server, s, unfinished)]
        for gdid in suspects:
            report.findings.append(_examine(store, area, server, gdid, copies, unfinished, repair))
        for state in states:
            finding, safe = _state_finding(store, area, server, state, data, unfinished)
            if safe and repair and finding.kind == "stale_apply_marker":
                removed = backend_of(store.map, server).clear_applying(store, server)
                finding = Finding(finding.kind, server, None, f"{finding.detail}; removed ({removed} marker(s))", "repaired")
            elif safe and repair:
                finding = (_repair_fence(store, area, server, state.gdid, tables, finding) if sql
                           else _repair_document_fence(store, area, server, state, data, finding))
            report.findings.append(finding)
        report.findings += [
            Finding("orphan_relocation", server, g, f"the relocation directory in CENTRAL sends the briefcase to {server!r}, "
                    "which holds no row of it; not changed (find it with `mdb where MAP AREA GDID`)")
            for g in sorted(expected) if g not in unfinished.briefcases
        ]
    # a briefcase whose only data lies off its routed server is still one briefcase of the area
    report.briefcases += sum(1 for g in stray if not scan_of(store, store.router.locate(area, g).server, data).rows_of(g))
    # The CENTRAL check confirms an entry on its briefcase's root row: SQL briefcase types only. A
    # document area's entries (MongoDB CENTRAL, mdb.mongo.central) are not checked here.
    indexes = [idx for idx in registered_indexes(store.registry) if idx.area == area] if store.types_of(area) else []
    report.central_indexes = sorted(idx.name for idx in indexes)
    report.findings += _central(store, indexes)
    return report
