"""A job's journal state: the reshard's steps in order, and every job kind's params typed and versioned
(mdb.moves.reshard_state, mdb.moves.movejob, mdb.moves.params)."""

from __future__ import annotations

import pytest

from mdb.errors import MdbError
from mdb.gdid import GDID
from mdb.moves.movejob import MoveJobParams
from mdb.moves.reshard_state import FROZEN_STEPS, PARAMS_VERSION, ReshardParams, ReshardStep

ROW_OF_AN_OLDER_MDB = {"partition_start": "0:0:0", "old_shards": ["a", "b"], "new_shards": ["a", "b", "x"],
                       "max_pause": 2.0, "map_path": "/srv/map.yaml", "throttle_rate": 50, "progress_window": [[1.0, 3, 30]]}


def test_the_steps_run_in_the_documented_order_and_the_frozen_ones_are_contiguous() -> None:
    order = [s.value for s in ReshardStep]
    assert order == ["plan", "prechecks", "moves", "freeze", "final_moves", "map_apply", "unfreeze", "cleanup"]
    walked, step = [], ReshardStep.PLAN
    while step is not None:
        walked.append(step)
        step = step.next()
    assert walked == list(ReshardStep)
    frozen = [i for i, s in enumerate(ReshardStep) if s in FROZEN_STEPS]
    assert [ReshardStep(order[i]) for i in frozen] == [ReshardStep.FREEZE, ReshardStep.FINAL_MOVES, ReshardStep.MAP_APPLY]
    assert frozen == list(range(frozen[0], frozen[-1] + 1))
    assert ReshardStep("map_apply") == "map_apply"  # journal rows and older code compare plain strings


def test_a_row_without_a_version_is_read_with_the_defaults_it_began_with() -> None:
    params = ReshardParams.of("reshard-1", ROW_OF_AN_OLDER_MDB)
    assert params.params_version == 1
    assert (params.parallel, params.batch_pause) == (1, 0.0)  # one thread, one briefcase at a time, as it began
    assert params.partition_start == GDID(0, 0, 0) and params.max_pause == 2.0
    written = params.to_params()
    assert "throttle_rate" not in written and "progress_window" not in written  # other owners' keys are theirs to write
    merged = {**ROW_OF_AN_OLDER_MDB, **written}
    assert merged["throttle_rate"] == 50 and ReshardParams.of("reshard-1", merged) == params


def test_a_new_row_round_trips_with_its_version() -> None:
    params = ReshardParams(params_version=PARAMS_VERSION, partition_start=GDID(0, 0, 5), old_shards=["a"], new_shards=["a", "b"],
                           parallel=4, batch_pause=0.025)
    params.map_version = 7
    again = ReshardParams.of("reshard-2", params.to_params())
    assert again == params and again.params_version == PARAMS_VERSION and again.map_version == 7
    assert "new_map_yaml" not in params.to_params()  # unset values are not written


@pytest.mark.parametrize(("row", "message"), [
    ({**ROW_OF_AN_OLDER_MDB, "params_version": PARAMS_VERSION + 1},
     f"reshard reshard-3 was journaled by a newer mdb (params version {PARAMS_VERSION + 1}, this one knows up to {PARAMS_VERSION})"),
    ({**ROW_OF_AN_OLDER_MDB, "partition_start": "nope"}, "reshard reshard-3: its journal row's params are not a reshard's (partition_start: "),
    ({"partition_start": "0:0:0", "old_shards": "a,b"},
     "reshard reshard-3: its journal row's params are not a reshard's (old_shards: Input should be a valid list; new_shards: Field required)"),
])
def test_a_row_this_mdb_cannot_drive_is_refused_in_one_line(row: dict[str, object], message: str) -> None:
    with pytest.raises(MdbError) as caught:
        ReshardParams.of("reshard-3", row)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


ROW_OF_A_REBALANCE = {"moves": [["0:0:7", "a", "b"], ["0:0:9", "b", "x"]], "servers": ["a", "b", "x"], "max_pause": 2.0,
                      "batch_pause": 0.01, "per_server": 3, "progress_window": [[1.0, 3, 30]]}


def test_a_rebalance_row_written_before_versions_reads_as_it_was_written_and_round_trips() -> None:
    params = MoveJobParams.of("rebalance-1", ROW_OF_A_REBALANCE)
    assert params.moves == [(GDID(0, 0, 7), "a", "b"), (GDID(0, 0, 9), "b", "x")]
    assert (params.max_pause, params.batch_pause, params.per_server, params.params_version) == (2.0, 0.01, 3, 1)
    written = params.to_params()
    assert {k: v for k, v in written.items() if k != "params_version"} == {k: v for k, v in ROW_OF_A_REBALANCE.items() if k != "progress_window"}
    assert MoveJobParams.of("rebalance-1", written) == params


@pytest.mark.parametrize(("row", "message"), [
    ({**ROW_OF_A_REBALANCE, "params_version": 7}, "job drain-1 was journaled by a newer mdb (params version 7, this one knows up to 1)"),
    ({**ROW_OF_A_REBALANCE, "moves": [["not a gdid", "a", "b"]]}, "job drain-1: its journal row's params are not a job's (moves.0.0: "),
    ({"servers": ["a"]}, "job drain-1: its journal row's params are not a job's (moves: Field required)"),
])
def test_a_job_row_this_mdb_cannot_drive_is_refused_in_one_line(row: dict[str, object], message: str) -> None:
    with pytest.raises(MdbError) as raised:
        MoveJobParams.of("drain-1", row)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)
