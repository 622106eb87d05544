"""What a reshard's journal row holds: the step it is at and its typed, versioned parameters.

A reshard is a state machine (:func:`mdb.moves.reshard.continue_reshard`): its journal row's
``step`` names the step about to run, written *before* that step runs, so a driver that dies
anywhere is resumed by running that step again (every step is idempotent or re-plans from the
live system). The parameters are the reshard's own typed view of the row's ``params``: read
once when a driver takes the job, written back with every step. The same dict also carries keys
other parts own (the throttle's settings, the progress's rate window), which pass through.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Final

from mdb.gdid import GDID
from mdb.moves.freeze import DEFAULT_FREEZE_LOCK_WAIT
from mdb.moves.jobs import DEFAULT_PER_SERVER
from mdb.moves.move import DEFAULT_MAX_PAUSE
from mdb.moves.params import JobParams

__all__ = ["FROZEN_STEPS", "PARAMS_VERSION", "ReshardParams", "ReshardStep"]


class ReshardStep(StrEnum):
    """A reshard's steps, in the order they run (docs/moves.md, "Resharding")."""

    PLAN = "plan"
    PRECHECKS = "prechecks"
    MOVES = "moves"
    """Online sweeps: the application keeps writing; what appears meanwhile moves in the next pass."""
    FREEZE = "freeze"
    FINAL_MOVES = "final_moves"
    MAP_APPLY = "map_apply"
    UNFREEZE = "unfreeze"
    CLEANUP = "cleanup"

    def next(self) -> ReshardStep | None:
        """The step after this one; None after the last."""
        order = list(ReshardStep)
        index = order.index(self) + 1
        return order[index] if index < len(order) else None


FROZEN_STEPS: Final = frozenset({ReshardStep.FREEZE, ReshardStep.FINAL_MOVES, ReshardStep.MAP_APPLY})
"""Steps that run with the partition frozen on its old shards: an error in one unfreezes it (the
journal stays at the step, so the driver that resumes freezes again)."""

PARAMS_VERSION: Final = 2
"""Version 1: rows journaled before the version was written (no ``parallel``: one thread; no
``batch_pause``: one briefcase at a time, as such a reshard began)."""


class ReshardParams(JobParams):
    """The reshard's own keys of its journal row's ``params``."""

    KIND: ClassVar[str] = "reshard"
    VERSION: ClassVar[int] = PARAMS_VERSION

    partition_start: GDID
    old_shards: list[str]
    new_shards: list[str]
    parallel: int = 1
    max_pause: float = DEFAULT_MAX_PAUSE
    batch_pause: float = 0.0
    freeze_wait: float = DEFAULT_FREEZE_LOCK_WAIT
    per_server: int = DEFAULT_PER_SERVER
    map_path: str | None = None
    """The map file the reshard rewrites, as an absolute path (older rows: as typed)."""
    map_version: int | None = None
    """The new map's version, once applied."""
    new_map_yaml: str | None = None
    """The new map's text, journaled before it is applied (so a resume applies the same one)."""
    map_backup: str | None = None
    """Where the map file's previous version was kept when the new one was written."""
