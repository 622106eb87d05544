"""Operator tools in one namespace: what the ``mdb`` command runs, for scripts and runbooks.

Map changes, schema, moves and reshards' recovery, fleet-wide migrations and repair. Like the
root package, each name is imported on first use: importing ``mdb.ops`` loads none of them.
Applications need only :mod:`mdb`; these act on a whole fleet and are run by an operator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mdb._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports each on first use
    from mdb.errors import (
        BatchAbortedError, BriefcaseGoneError, CancelError, LeaseLostError, LockTimeoutError, MapEditError,
        MigrationError, MoveAbortedError, MoveLeaseHeldError, ReshardStoppedError,
    )
    from mdb.fleet.balance import balance
    from mdb.fleet.drain import check_drain, drain
    from mdb.fleet.fsck import FsckReport, fsck
    from mdb.fleet.rebalance import RebalancePlan, apply_plan, plan_rebalance
    from mdb.fleet.status import FleetReport, fleet_report
    from mdb.maps.apply import ApplyReport, apply_map
    from mdb.maps.diff import MapDiff, diff_maps
    from mdb.maps.high_water import high_water_marks
    from mdb.migrations.fleet import MigrationRun, migrate
    from mdb.moves import Journal, MoveResult, ResumeOutcome, move_briefcase, resume_all
    from mdb.schema import ShardReport, apply_schema, check_schema

_WHERE: dict[str, str] = {
    "ApplyReport": "mdb.maps.apply",
    "FleetReport": "mdb.fleet.status",
    "FsckReport": "mdb.fleet.fsck",
    "Journal": "mdb.moves",
    "MapDiff": "mdb.maps.diff",
    "MigrationRun": "mdb.migrations.fleet",
    "MoveResult": "mdb.moves",
    "RebalancePlan": "mdb.fleet.rebalance",
    "ResumeOutcome": "mdb.moves",
    "ShardReport": "mdb.schema",
    "apply_map": "mdb.maps.apply",
    "apply_plan": "mdb.fleet.rebalance",
    "apply_schema": "mdb.schema",
    "balance": "mdb.fleet.balance",
    "check_drain": "mdb.fleet.drain",
    "check_schema": "mdb.schema",
    "diff_maps": "mdb.maps.diff",
    "drain": "mdb.fleet.drain",
    "fleet_report": "mdb.fleet.status",
    "fsck": "mdb.fleet.fsck",
    "high_water_marks": "mdb.maps.high_water",
    "migrate": "mdb.migrations.fleet",
    "move_briefcase": "mdb.moves",
    "plan_rebalance": "mdb.fleet.rebalance",
    "resume_all": "mdb.moves",
    **dict.fromkeys(
        ("BatchAbortedError", "BriefcaseGoneError", "CancelError", "LeaseLostError", "LockTimeoutError", "MapEditError",
         "MigrationError", "MoveAbortedError", "MoveLeaseHeldError", "ReshardStoppedError"),
        "mdb.errors",
    ),
}
"""Each operator name and the module that defines it."""

__all__ = [
    "ApplyReport",
    "BatchAbortedError",
    "BriefcaseGoneError",
    "CancelError",
    "FleetReport",
    "FsckReport",
    "Journal",
    "LeaseLostError",
    "LockTimeoutError",
    "MapDiff",
    "MapEditError",
    "MigrationError",
    "MigrationRun",
    "MoveAbortedError",
    "MoveLeaseHeldError",
    "MoveResult",
    "RebalancePlan",
    "ReshardStoppedError",
    "ResumeOutcome",
    "ShardReport",
    "apply_map",
    "apply_plan",
    "apply_schema",
    "balance",
    "check_drain",
    "check_schema",
    "diff_maps",
    "drain",
    "fleet_report",
    "fsck",
    "high_water_marks",
    "migrate",
    "move_briefcase",
    "plan_rebalance",
    "resume_all",
]


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
