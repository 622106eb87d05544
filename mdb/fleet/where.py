"""``mdb where``: where a briefcase is, asked of the live system rather than of the router alone.

It asks every server of the briefcase's kind for its rows and state record (through the server's
backend, :meth:`~mdb.backends.base.Backend.holding`), and CENTRAL for the relocation entry and
the journal, so an operator sees a disagreement (a fence without a relocation, an unfinished
copy) instead of a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from mdb.backends import backend_of, servers_where
from mdb.cluster import Cluster
from mdb.fleet.scan import area_data
from mdb.gdid import GDID
from mdb.moves.journal import Journal
from mdb.moves.lease import describe, liveness
from mdb.moves.move import move_kinds
from mdb.relocations import relocation_of

__all__ = ["BriefcaseWhere", "where"]


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
    relocation = relocation_of(store, area, gdid)  # its one entry, not the whole directory
    placement = router.default_placement(area, gdid)
    if relocation is not None and relocation != placement.server:
        placement = router.placement_on(area, gdid, relocation)
    out = BriefcaseWhere(area, gdid, placement.server, placement.default_server, relocation)
    data = area_data(store, area)  # no type of the area registered: RoutingError, once
    backend = backend_of(store.map, placement.default_server)
    for server in servers_where(store.map, lambda b: b is backend):  # a move never leaves its kind
        try:
            held = backend.holding(store, server, data, gdid)
        except Exception as exc:  # the server's own error is reported per server; anything else is a bug
            translated = backend.translate(store, server, exc)
            if translated is None:
                raise
            out.unreachable[server] = str(translated)
            continue
        if held.rows:
            out.holders[server] = held.rows
        if held.state is not None:
            s = held.state
            out.states[server] = {"state": s.state, "peer": s.peer, "move_id": s.move_id,
                                  "changed_at": s.changed_at.isoformat() if isinstance(s.changed_at, datetime) else s.changed_at}
    journal = Journal(store)
    kinds = move_kinds()
    out.moves_in_flight = [
        {**e.to_json(), "driver": describe(*liveness(journal, e))}
        for e in journal.entries(unfinished=True) if e.kind in kinds and e.area == area and gdid in e.briefcases
    ]
    return out
