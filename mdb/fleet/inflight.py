"""What the move journal says is in flight in an area: the read-only question repair tools ask first.

DESIGN.md invariant 7: a repair tool never touches a briefcase that a running or interrupted
move still names. Running and interrupted look alike in the journal (status ``running``: an
interrupted driver never wrote an end), so both count. Every kind of journal row counts that
names briefcases: a single move (``move``, ``mongo-move``) names one, a reshard's batch
(``batch-move``) names all of its ``params['gdids']`` (:attr:`JournalEntry.briefcases`); a
reshard row names a partition (its freeze markers). Read through :class:`Journal`'s public
reads only: the journal's format is the move machinery's.
"""

from __future__ import annotations

from dataclasses import dataclass

from mdb.cluster import Cluster
from mdb.gdid import GDID
from mdb.moves.journal import Journal

__all__ = ["InFlight", "in_flight"]

RESHARD_KIND = "reshard"


@dataclass(frozen=True)
class InFlight:
    """Unfinished journal rows of one area: which move ids, briefcases and reshards they name."""

    moves: dict[str, frozenset[GDID]]
    """move id -> the briefcases it names (every unfinished row but a reshard's)."""
    reshards: frozenset[str]
    """move ids of unfinished reshards (their freeze markers are theirs)."""
    briefcases: frozenset[GDID]
    """Every briefcase some unfinished move names."""

    def naming(self, gdid: GDID) -> list[str]:
        """The unfinished moves that name ``gdid`` (empty: none)."""
        return [move_id for move_id, named in self.moves.items() if gdid in named]


def in_flight(store: Cluster, area: str) -> InFlight:
    """Read the journal now: every running or interrupted move, batch and reshard of ``area``."""
    entries = [e for e in Journal(store).entries(unfinished=True) if e.area == area]
    moves = {e.move_id: frozenset(e.briefcases) for e in entries if e.kind != RESHARD_KIND}
    named: set[GDID] = set()
    for gdids in moves.values():
        named |= gdids
    return InFlight(moves, frozenset(e.move_id for e in entries if e.kind == RESHARD_KIND), frozenset(named))
