"""Fleet operations run several servers at once (issue 19): a slow shard does not hold up the rest.

The proof is structural, not a stopwatch: one server's layout table is locked by another
session, so that server cannot finish; the other servers' reports must all arrive while it is
still blocked. Done one by one in map order (the old code), the blocked first server would hold
every other one back until the lock is released.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from support.mapfiles import write_map
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from mdb import Store
from mdb.cli import app
from mdb.demo.models import UserBriefcase
from mdb.parallel import run_each
from mdb.schema import ShardReport, apply_schema, check_schema

PARTITIONS = [("0:0:0", ["u1", "u2", "u3"])]
WAIT = 60.0  # seconds: generous, only a deadlock or a sequential run reaches it


def _store(tmp_path: Path, urls: list[str]) -> Store:
    path = write_map(tmp_path, dict(zip(["c", "u1", "u2", "u3"], urls)), central=["c"], partitions=PARTITIONS)
    store = Store.from_yaml(path, types=[UserBriefcase])
    assert all(r.ok for r in apply_schema(store))
    return store


@pytest.mark.parametrize("operation", ["apply", "check"])
def test_a_blocked_server_does_not_hold_up_the_others(
    tmp_path: Path, pg_databases: Callable[[int], list[str]], operation: str
) -> None:
    urls = pg_databases(4)
    store = _store(tmp_path, urls)
    blocker = create_engine(urls[0])  # "c", the first server in map order
    others_done = threading.Event()
    done: list[str] = []

    def on_done(report: ShardReport) -> None:
        done.append(report.server)
        if {"u1", "u2", "u3"} <= set(done):
            others_done.set()

    run = apply_schema if operation == "apply" else check_schema
    result: list[list[ShardReport]] = []
    try:
        with blocker.connect() as conn:
            conn.execute(text("LOCK TABLE mdb_shard_layout IN ACCESS EXCLUSIVE MODE"))
            worker = threading.Thread(target=lambda: result.append(run(store, parallel=4, on_done=on_done)))
            worker.start()
            finished_while_blocked = others_done.wait(WAIT)
            blocked_server_done = "c" in done
            conn.rollback()  # releases the lock: "c" can finish now
        worker.join(WAIT)
        assert finished_while_blocked, f"only {done} finished while server c was blocked"
        assert not blocked_server_done
        assert not worker.is_alive()
        reports = result[0]
        assert [r.server for r in reports] == ["c", "u1", "u2", "u3"]  # map order, not finishing order
        assert all(r.ok for r in reports), [(r.server, r.error, r.problems, r.differences) for r in reports]
        assert done[-1] == "c"
    finally:
        blocker.dispose()
        store.close()


def test_run_each_keeps_item_order_and_refuses_a_bad_bound() -> None:
    release = threading.Event()

    def work(n: int) -> int:
        if n == 0:
            assert release.wait(WAIT)  # the first item finishes last
        else:
            finished.append(n)
            if len(finished) == 3:
                release.set()
        return n * 10

    finished: list[int] = []
    assert run_each([0, 1, 2, 3], work, parallel=4) == [0, 10, 20, 30]
    with pytest.raises(ValueError, match="at least 1"):
        run_each([1], work, parallel=0)


def test_cli_parallel_option(tmp_path: Path, tmp_sqlite_urls: Callable[[int], list[str]]) -> None:
    urls = tmp_sqlite_urls(4)
    path = write_map(tmp_path, dict(zip(["c", "u1", "u2", "u3"], urls)), central=["c"], partitions=PARTITIONS)
    runner = CliRunner()
    bad = runner.invoke(app, ["schema", "apply", str(path), "--models", "mdb.demo.models", "--parallel", "0"])
    assert bad.exit_code == 2, bad.output
    ok = runner.invoke(app, ["schema", "apply", str(path), "--models", "mdb.demo.models", "--parallel", "3"],
                       env={"COLUMNS": "250"})
    assert ok.exit_code == 0, ok.output
    assert "all 4 shards ok" in ok.stdout
    again = runner.invoke(app, ["schema", "check", str(path), "--models", "mdb.demo.models", "--parallel", "2"])
    assert again.exit_code == 0, again.output
