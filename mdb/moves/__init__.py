"""Moving briefcases between servers online, and re-sharding partitions (docs/design.md invariant 3).

:func:`move_briefcase` moves one briefcase (the mover of the kind of server it lives
on: :class:`SingleMove`, a batch of one, or :class:`DocumentMove`); :func:`reshard` moves every briefcase of a
partition whose shard changes under a new shard list, then applies the new map;
:func:`resume_all` finishes or rolls back whatever a crash interrupted; :func:`where` and
:func:`status` report on the live system. See docs/moves.md.

Importing this package registers every move implementation (:func:`mdb.moves.move.register_mover`).
"""

from mdb.moves.batch import SingleMove
from mdb.moves.document_move import DocumentMove
from mdb.moves.journal import Journal, JournalEntry
from mdb.moves.move import Move, MoveResult, move_briefcase
from mdb.moves.resume import ResumeOutcome, resume_all

__all__ = [
    "DocumentMove",
    "Journal",
    "JournalEntry",
    "Move",
    "MoveResult",
    "ResumeOutcome",
    "SingleMove",
    "move_briefcase",
    "resume_all",
]
