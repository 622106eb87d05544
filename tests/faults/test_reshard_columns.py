"""A mover holding older models never drops a column a migration added between its passes (issue 28 item 3).

A real ``mdb reshard`` runs with the models it imported; it is paused (SIGSTOP) between two of
its passes, after the first pass let its schema locks go. Meanwhile every shard gets a new
column and the application's new version writes it for briefcases created then, which the
reshard's next pass moves. Before, that pass copied them with the old column list and the new
values arrived as NULL. Now the pass compares the live tables with its models under its schema
lock and refuses, naming the column; the values stay where they were, and the reshard is left
for `mdb moves resume` once the mover runs the new models.
"""

from __future__ import annotations

import pytest
import os
import signal
import subprocess
import sys

from support import forkserver
from support.moves import ROOT, Cluster, add_transaction, create_user
from sqlalchemy import text
from support.reshard import _wait_stopped
from support.reshard import SERVERS, cluster  # noqa: F401 (fixtures: cluster)

from mdb.gdid import GDID
from mdb.moves.journal import Journal

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

OLD, NEW = ["u1", "u2"], ["u1", "u2", "x"]


def test_a_column_added_between_two_passes_is_refused_not_dropped(cluster: Cluster) -> None:  # noqa: F811
    newcomers = [GDID(0, 0, c) for c in range(100, 130) if OLD[c % 2] != NEW[c % 3]][:3]  # they move under 2 -> 3
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MDB_FAULT_POINT": "reshard.between_passes", "MDB_FAULT_ACTION": "stop"}
    mover = forkserver.popen(
        [sys.executable, "-c", "from mdb.cli import main; main()", "reshard", str(cluster.path), "user",
         "--partition", "0:0:0", "--shards", ",".join(NEW)],
        cwd=str(ROOT), env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        _wait_stopped(mover, "reshard.between_passes")
        with cluster.store() as admin:
            for server in SERVERS:  # the migration, run while no pass holds the schema lock
                with admin.transaction(server) as conn:
                    conn.execute(text("ALTER TABLE transactions ADD COLUMN note text"))
            for n, g in enumerate(newcomers):  # the new application version writes the new column
                create_user(admin, g, orders=1, lines=1)
                add_transaction(admin, g, 9_000_000 + n, n)
                with admin.transaction(admin.router.locate("user", g).server) as conn:
                    conn.execute(text("UPDATE transactions SET note = 'kept' WHERE transaction_id = :t"),
                                 {"t": bytes(GDID(0, 4, 9_000_000 + n))})
        mover.send_signal(signal.SIGCONT)
        out, err = mover.communicate(timeout=300)
    finally:
        if mover.poll() is None:
            mover.kill()
            mover.wait()
    assert mover.returncode == 2, (out, err)
    assert "reshard pass of area 'user'" in err and "note" in err, err
    with cluster.store() as admin:
        kept = 0
        for server in SERVERS:
            with admin.transaction(server) as conn:
                kept += conn.execute(text("SELECT count(*) FROM transactions WHERE note = 'kept'")).scalar_one()
        assert kept == len(newcomers), f"{len(newcomers) - kept} value(s) of the new column lost"
        (left,) = [e for e in Journal(admin).entries(unfinished=True) if e.kind == "reshard"]  # for resume, new models
        assert left.area == "user"
