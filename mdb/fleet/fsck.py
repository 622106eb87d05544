"""``mdb fsck``: what lies on an area's shards that the routing does not explain, and which of it is safe to remove.

Every server of the area (layout plus relocation targets) is scanned twice, both streamed:
its briefcases (:func:`mdb.fleet.scan.briefcase_sizes`) and its state rows. Each briefcase is
routed with ``store.router`` (map + relocation directory); one whose rows sit on a server the
router does not send it to is a *suspect*, examined afterwards (suspects are few; the keys of a
shard are never held in memory). Findings:

- ``unfinished_move``: rows, an ``incoming`` row or a freeze marker of a move or reshard the
  journal says is unfinished. Never touched: ``mdb moves resume MAP`` resolves it.
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
- ``orphan_relocation``: a relocation directory entry (CENTRAL) sending a briefcase to a server
  that holds no row of it (checked during the same scan). Reported only.
- ``central_<kind>``: CENTRAL index entries out of step (:func:`mdb.central.reconcile.check`,
  e.g. ``dangling``: an entry pointing at no briefcase). ``mdb central repair MAP`` fixes them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.engine import Connection

from mdb.central.indexes import CentralIndex, registered_indexes
from mdb.central.reconcile import check as central_check
from mdb.fleet.balance import area_servers
from mdb.fleet.scan import STREAM_BATCH, briefcase_sizes
from mdb.gdid import GDID
from mdb.moves import verify
from mdb.moves.copy import AreaTable, delete_rows, measure
from mdb.moves.journal import Journal, JournalEntry
from mdb.moves.move import DEFAULT_LOCK_WAIT, DEFAULT_MAX_PAUSE, area_tables, locked_source
from mdb.system_tables import STATE_FROZEN, STATE_GONE, STATE_INCOMING, briefcase_state
from mdb.urls import SQL

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


@dataclass(frozen=True)
class _Unfinished:
    """What the journal says is in flight: briefcases of unfinished moves, partitions of unfinished reshards."""

    moves: dict[str, JournalEntry]
    briefcases: frozenset[GDID]
    reshards: frozenset[str]

    @classmethod
    def of(cls, store: Any, area: str) -> _Unfinished:
        entries = [e for e in Journal(store).entries(unfinished=True) if e.area == area]
        moves = {e.move_id: e for e in entries if e.kind == "move"}
        return cls(moves, frozenset(e.gdid for e in moves.values() if e.gdid is not None), frozenset(e.move_id for e in entries if e.kind != "move"))


def _state_rows(conn: Connection, area: str) -> Iterator[dict[str, Any]]:
    query = select(briefcase_state).where(briefcase_state.c.area == area).order_by(briefcase_state.c.gdid)
    for row in conn.execution_options(yield_per=STREAM_BATCH).execute(query).mappings():
        yield dict(row)


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


def _remove_copy(store: Any, area: str, server: str, owner: str, gdid: GDID, tables: Sequence[AreaTable]) -> int | None:
    """Delete a verified leftover copy on ``server``: checked again under the briefcase's write lock there.

    None when the check under the lock no longer holds (nothing deleted).
    """
    with locked_source(store, server, area, gdid, lock_wait=DEFAULT_LOCK_WAIT, max_pause=DEFAULT_MAX_PAUSE) as (conn, _):
        if store.router.locate(area, gdid).server == server or _foreign_rows(store, owner, tables, gdid, conn):
            return None
        deleted = sum(delete_rows(conn, tables, gdid).values())
        _resident_or_incoming(conn, area, gdid)  # its incoming/resident row goes with the copy; a fence stays
        conn.commit()
        return deleted


def _examine(store: Any, area: str, server: str, gdid: GDID, tables: Sequence[AreaTable], unfinished: _Unfinished, repair: bool) -> Finding:
    """A briefcase with rows on a server it is not routed to: unfinished move, leftover copy or misplaced."""
    if gdid in unfinished.briefcases:
        ids = ", ".join(m for m, e in unfinished.moves.items() if e.gdid == gdid)
        return Finding("unfinished_move", server, gdid, f"rows of a briefcase whose move {ids} is unfinished", RESUME)
    owner = store.router.locate(area, gdid).server
    with store.transaction(server) as here:
        differing = _foreign_rows(store, owner, tables, gdid, here)
    if differing:
        return Finding("misplaced", server, gdid, f"{differing} row(s) that {owner!r}, where the briefcase is routed, lacks "
                       "or holds differently; not removed (it may be the only copy)")
    detail = f"a copy of rows {owner!r} holds (the briefcase is routed there)"
    if not repair:
        return Finding("leftover_copy", server, gdid, detail)
    deleted = _remove_copy(store, area, server, owner, gdid, tables)
    if deleted is None:
        return Finding("leftover_copy", server, gdid, detail + "; changed while repairing, left as it is (run fsck again)")
    return Finding("leftover_copy", server, gdid, f"{detail}; deleted {deleted} row(s) here", "repaired")


def _odd_state(store: Any, area: str, server: str, state: dict[str, Any], unfinished: _Unfinished) -> bool:
    """A state row the routing and the journal do not explain (a fence on a server moved away from is normal)."""
    kind, gdid = state["state"], state["gdid"]
    if kind == STATE_FROZEN:
        return state["move_id"] not in unfinished.reshards
    if kind == STATE_INCOMING:
        return state["move_id"] not in unfinished.moves
    here = store.router.locate(area, gdid).server == server
    return here if kind == STATE_GONE else not here


def _rows_of(store: Any, server: str, tables: Sequence[AreaTable], gdid: GDID) -> int:
    with store.transaction(server) as conn:
        return sum(n for n, _ in measure(conn, tables, gdid, with_bytes=False).values())


def _examine_state(store: Any, area: str, server: str, state: dict[str, Any], tables: Sequence[AreaTable], unfinished: _Unfinished, repair: bool) -> Finding:
    kind, gdid, peer = state["state"], state["gdid"], state["peer"]
    if kind == STATE_FROZEN:
        return Finding("stale_freeze", server, None, f"freeze marker of partition {peer} by {state['move_id']!r}, which the journal "
                       "does not list as an unfinished reshard: writes of that partition wait; remove it by hand once sure no reshard runs")
    if kind == STATE_INCOMING:
        return Finding("stale_incoming", server, gdid, f"'incoming' row of move {state['move_id']!r}, which the journal "
                       "does not list as unfinished (removed with its copy when that copy is a verified leftover)")
    if kind != STATE_GONE:
        return Finding("stale_resident", server, gdid, f"{kind!r} row here, but the relocation directory routes the "
                       f"briefcase to {store.router.locate(area, gdid).server!r}")
    detail = f"fence (moved to {peer!r}, move {state['move_id']!r}) on the server the briefcase is routed to: its sessions are refused"
    peer_rows = _rows_of(store, peer, tables, gdid) if peer in store.map.servers else 0
    safe = gdid not in unfinished.briefcases and peer_rows == 0 and _rows_of(store, server, tables, gdid) > 0
    if not safe:
        return Finding("stale_fence", server, gdid, detail + f"; not removed ({peer!r} holds {peer_rows} row(s) of it, or no row is here)")
    if not repair:
        return Finding("stale_fence", server, gdid, detail + f"; the rows are here and {peer!r} holds none: --repair removes it")
    with locked_source(store, server, area, gdid, lock_wait=DEFAULT_LOCK_WAIT, max_pause=DEFAULT_MAX_PAUSE) as (conn, _):
        if not sum(n for n, _ in measure(conn, tables, gdid, with_bytes=False).values()):  # checked again under the lock
            return Finding("stale_fence", server, gdid, detail + "; changed while repairing, left as it is (run fsck again)")
        conn.execute(delete(briefcase_state).where(briefcase_state.c.area == area, briefcase_state.c.gdid == gdid,
                                                   briefcase_state.c.state == STATE_GONE))
        conn.commit()
    return Finding("stale_fence", server, gdid, detail + "; removed (the rows are here, the peer holds none)", "repaired")


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


def fsck(store: Any, area: str, *, repair: bool = False) -> FsckReport:
    """Check (and with ``repair`` fix what is provably safe) every server of ``area`` and its CENTRAL entries."""
    store.refresh()
    servers = area_servers(store, area)
    report = FsckReport(area, servers)
    sql_servers = [s for s in servers if store.map.kind_of(s) == SQL]
    report.not_checked = [s for s in servers if s not in sql_servers]
    if not sql_servers:
        return report
    tables = area_tables(store, area)
    unfinished = _Unfinished.of(store, area)
    relocated: dict[str, set[GDID]] = {}  # server -> briefcases the directory sends there (already in the router)
    for (a, g), target in store.router.relocations.items():
        if a == area:
            relocated.setdefault(target, set()).add(g)
    for server in sql_servers:
        suspects: list[GDID] = []
        expected = relocated.get(server, set())
        with store.transaction(server) as conn:
            for b in briefcase_sizes(conn, tables):
                report.briefcases += 1
                expected.discard(b.gdid)
                if store.router.locate(area, b.gdid).server != server:
                    suspects.append(b.gdid)
            states = [s for s in _state_rows(conn, area) if _odd_state(store, area, server, s, unfinished)]
        for gdid in suspects:
            report.findings.append(_examine(store, area, server, gdid, tables, unfinished, repair))
        for state in states:
            report.findings.append(_examine_state(store, area, server, state, tables, unfinished, repair))
        report.findings += [
            Finding("orphan_relocation", server, g, f"the relocation directory in CENTRAL sends the briefcase to {server!r}, "
                    "which holds no row of it; not changed (find it with `mdb where MAP AREA GDID`)")
            for g in sorted(expected) if g not in unfinished.briefcases
        ]
    indexes = [idx for idx in registered_indexes() if idx.area == area]
    report.central_indexes = sorted(idx.name for idx in indexes)
    report.findings += _central(store, indexes)
    return report
