"""Moving briefcases between servers online, and re-sharding partitions (docs/design.md invariant 3).

:func:`move_briefcase` moves one briefcase; :func:`reshard` moves every briefcase of a
partition whose shard changes under a new shard list, then applies the new map;
:func:`resume_all` finishes or rolls back whatever a crash interrupted; :func:`where`
and :func:`status` report on the live system. See docs/moves.md.
"""

from mdb.moves.journal import Journal, JournalEntry
from mdb.moves.move import MoveResult, move_briefcase
from mdb.moves.resume import ResumeOutcome, resume_all

__all__ = [
    "Journal",
    "JournalEntry",
    "MoveResult",
    "ResumeOutcome",
    "move_briefcase",
    "resume_all",
]
