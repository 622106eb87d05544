"""The one registry of crash points (mdb.faults): no name twice, no point passed unregistered.

That every protocol's points are reached is checked where a process is killed at each of them
(test_moves_faults.py iterates the registry's move, reshard, resume, cancel and batch points;
test_central_create.py the creation steps; test_mongo_moves.py the document move's).
Importing the protocols below together is itself a check: a name two of them register fails.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mdb import faults
from mdb.central import creation  # noqa: F401  (they register their points)
from mdb.errors import FaultPointError
from mdb.moves import batch, cancel, cutover, document_move, freeze, reshard, sql_steps  # noqa: F401


@pytest.fixture(autouse=True)
def _no_hook() -> Iterator[None]:
    yield
    faults.hook = None


def test_a_name_registered_twice_fails() -> None:
    with pytest.raises(FaultPointError, match="registered twice"):
        faults.register("batch.after_lock")
    with pytest.raises(FaultPointError, match="registered twice"):
        faults.register("mongo.move.after_copy")


def test_an_unregistered_point_fails_and_the_hook_sees_registered_ones() -> None:
    with pytest.raises(FaultPointError, match="not registered"):
        faults.fault_point("move.no_such_point")
    seen: list[str] = []
    faults.hook = seen.append
    faults.fault_point("central.create.start")
    assert seen == ["central.create.start"]
