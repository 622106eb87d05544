"""The one registry of crash points (mdb.faults): every protocol's points, no name twice."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mdb import faults
from mdb.central import creation
from mdb.errors import FaultPointError
from mdb.moves import cancel, document_move, freeze, reshard, sql_move, sql_steps


@pytest.fixture(autouse=True)
def _no_hook() -> Iterator[None]:
    yield
    faults.hook = None


def test_every_protocol_registers_its_points_in_the_one_registry() -> None:
    every = set(faults.points())
    for declared in (sql_move.FAULT_POINTS, sql_steps.FINALIZE_POINTS, reshard.FAULT_POINTS, freeze.FAULT_POINTS,
                     cancel.FAULT_POINTS, document_move.FAULT_POINTS, creation.FAULT_POINTS):
        assert set(declared) <= every
    assert {"move.after_copy_commit", "mongo.move.after_fence", "central.create.written", "resume.after_discard"} <= every
    assert len(faults.points()) == len(every)  # no name twice


def test_a_name_registered_twice_fails() -> None:
    with pytest.raises(FaultPointError, match="registered twice"):
        faults.register("move.after_lock")
    with pytest.raises(FaultPointError, match="registered twice"):
        faults.register("mongo.move.after_copy")


def test_an_unregistered_point_fails_and_the_hook_sees_registered_ones() -> None:
    with pytest.raises(FaultPointError, match="not registered"):
        faults.fault_point("move.no_such_point")
    seen: list[str] = []
    faults.hook = seen.append
    faults.fault_point("central.create.start")
    assert seen == ["central.create.start"]
