"""What the live system says: where a briefcase is, and what moves and reshards are in flight.

``where`` does not trust the router alone: it asks every server of the map for the briefcase's
root row and state row, and CENTRAL for the relocation entry and the journal, so an operator
sees a disagreement (a fence without a relocation, an unfinished copy) instead of a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, inspect as sa_inspect, select

from mdb.cluster import Cluster
from mdb.errors import MdbError, RoutingError
from mdb.gdid import GDID
from mdb.moves.journal import RUNNING, Journal, JournalEntry
from mdb.moves.lease import Holder, describe, liveness
from mdb.moves.directory import documents_of
from mdb.moves.document_move import document_holdings
from mdb.moves.move import move_kinds
from mdb.moves.sql_steps import area_tables, state_row
from mdb.urls import MONGO, SQL
from mdb.backends.sql import relocations

__all__ = ["BriefcaseWhere", "MoveStatus", "move_status", "status_of", "where"]


@dataclass
class BriefcaseWhere:
    area: str
    gdid: GDID
    routed_to: str
    default_server: str
    relocation: str | None
    holders: dict[str, int] = field(default_factory=dict)
    """server -> rows of the briefcase found there (all tables)."""
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)
    moves_in_flight: list[dict[str, Any]] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        return list(self.holders) == [self.routed_to] or (not self.holders and not self.moves_in_flight)

    def to_json(self) -> dict[str, Any]:
        return {
            "area": self.area, "gdid": str(self.gdid), "routed_to": self.routed_to,
            "default_server": self.default_server, "relocation": self.relocation, "holders": self.holders,
            "states": self.states, "unreachable": self.unreachable, "moves_in_flight": self.moves_in_flight,
            "consistent": self.consistent,
        }


def where(store: Cluster, area: str, gdid: GDID) -> BriefcaseWhere:
    """Where routing sends the briefcase, which servers of its kind hold any of it, and its moves in flight."""
    store.refresh()
    router = store.router
    placement = router.locate(area, gdid)
    central = router.locate_central(gdid).server
    if store.map.kind_of(central) == MONGO:  # the directory the router loaded is the one in CENTRAL
        relocation = router.relocations.get((area, gdid))
    else:
        with store.transaction(central) as conn:
            relocation = conn.execute(
                select(relocations.c.server).where(relocations.c.area == area, relocations.c.gdid == gdid)
            ).scalar_one_or_none()
    out = BriefcaseWhere(area, gdid, placement.server, placement.default_server, relocation)
    if store.map.kind_of(placement.default_server) == MONGO:
        if not documents_of(store).types_of(area):  # once, not as every server "unreachable"
            raise RoutingError(f"no document type of area {area!r} is registered (list its module under models: in the map)")
        for server in store.map.servers_of_kind(MONGO):
            try:
                rows, state = document_holdings(store, area, gdid, server)
            except MdbError as exc:
                out.unreachable[server] = str(exc)
                continue
            if state is not None:
                out.states[server] = state
            if rows:
                out.holders[server] = rows
    else:
        _sql_holdings(store, area, gdid, out)
    journal = Journal(store)
    kinds = move_kinds()
    out.moves_in_flight = [
        {**e.to_json(), "driver": describe(*liveness(journal, e))}
        for e in journal.entries(unfinished=True) if e.kind in kinds and e.area == area and e.gdid == gdid
    ]
    return out


def _sql_holdings(store: Cluster, area: str, gdid: GDID, out: BriefcaseWhere) -> None:
    """Rows and state rows of the briefcase on every SQL server."""
    tables = area_tables(store, area)
    for server in store.map.servers_of_kind(SQL):
        try:
            with store.transaction(server) as conn:
                present = set(sa_inspect(conn).get_table_names())
                if "mdb_briefcase_state" in present:
                    state = state_row(conn, area, gdid)
                    if state is not None:
                        out.states[server] = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in state.items() if k in ("state", "peer", "move_id", "changed_at")}
                rows = sum(
                    conn.execute(select(func.count()).select_from(at.table).where(at.table.c[at.key] == gdid)).scalar_one()
                    for at in tables if at.name in present
                )
                if rows:
                    out.holders[server] = rows
        except MdbError as exc:
            out.unreachable[server] = str(exc)


@dataclass
class MoveStatus:
    entry: JournalEntry
    rate_rows: float | None
    rate_briefcases: float | None
    eta_seconds: float | None
    driver: str | None = None
    """Unfinished entries: "running (pid, host, last beat)" or "interrupted: run ..." (mdb.moves.lease)."""
    holder: Holder | None = None

    def to_json(self) -> dict[str, Any]:
        return {**self.entry.to_json(), "rows_per_second": self.rate_rows, "briefcases_per_second": self.rate_briefcases,
                "eta_seconds": self.eta_seconds, "driver": self.driver,
                "holder": None if self.holder is None else self.holder.to_json()}


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def status_of(entry: JournalEntry, now: datetime) -> MoveStatus:
    """Rates over the move's own run time: until now while it runs, until its last journal
    update once it ended (a finished move's rate must not fall as time passes)."""
    if entry.started_at is None:
        return MoveStatus(entry, None, None, None)
    end = now if entry.status == RUNNING or entry.updated_at is None else _utc(entry.updated_at)
    elapsed = (end - _utc(entry.started_at)).total_seconds()
    if elapsed <= 0:  # SQLite's CURRENT_TIMESTAMP has whole seconds: a quick move took "0 s"
        return MoveStatus(entry, None, None, None)
    rate_rows = entry.rows_done / elapsed if entry.rows_done else None
    rate_bc = entry.briefcases_done / elapsed if entry.briefcases_done else None
    eta = None
    if rate_rows:
        eta = max(entry.rows_total - entry.rows_done, 0) / rate_rows
    elif rate_bc:
        eta = max(entry.briefcases_total - entry.briefcases_done, 0) / rate_bc
    return MoveStatus(entry, rate_rows, rate_bc, eta)


def move_status(store: Cluster, *, recent: int = 10) -> tuple[list[MoveStatus], list[MoveStatus]]:
    """(in flight, recently finished) journal entries with rate and ETA computed from exact counts."""
    journal = Journal(store)
    now = datetime.now(timezone.utc)
    running = [status_of(e, now) for e in journal.entries(unfinished=True)]
    for s in running:
        if s.entry.kind not in ("move", "reshard"):
            continue  # e.g. document moves (mdb.mongo) record no driver
        # ETA and rate mean nothing for an entry whose process is gone (issue 11 item 10: a
        # reshard stopped by Ctrl-C still showed "ETA 120s"), so they go with its liveness.
        state, s.holder = liveness(journal, s.entry)
        s.driver = describe(state, s.holder)
        if state != "running":
            s.rate_rows = s.rate_briefcases = s.eta_seconds = None
    finished = [status_of(e, now) for e in journal.entries(finished=True, limit=recent)]
    return running, finished
