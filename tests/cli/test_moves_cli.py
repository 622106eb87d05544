"""What the move commands print and exit with (issue 11 item 4 and the move polish).

A reshard rewrites the map file as YAML data: the file as it was (comments, layout) is kept
beside it and the command says where. The final line, the journal and `mdb moves status` give
the same counts. A move to the server the briefcase is on prints only "nothing to do". A move
aborted by --max-pause exits 4 (aborted safely, retry later; decisions.md), not 2 (bad input).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.moves import Cluster, run_cli
from support.online import SERVERS, USERS, cluster  # noqa: F401 (fixture: cluster)

from mdb.errors import MoveAbortedError, RetryableError
from mdb.gdid import GDID
from mdb.moves.journal import Journal



@pytest.mark.slow  # 165 s measured at load ~15 on 2 cores: docs/testing.md
def test_reshard_keeps_the_old_map_file_and_its_counts_agree(cluster: Cluster) -> None:
    original = "# production map: the on-call runbook links here\n" + cluster.path.read_text(encoding="utf-8")
    cluster.path.write_text(original, encoding="utf-8")
    run = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,u2,x"])
    assert run.returncode == 0, (run.stdout, run.stderr)
    kept = re.search(r"the previous file is at (\S+)", run.stdout)
    assert kept is not None, run.stdout
    backup = Path(kept.group(1))
    assert backup.parent == cluster.path.parent and backup.read_text(encoding="utf-8") == original
    assert yaml.safe_load(cluster.path.read_text(encoding="utf-8"))["version"] == 2
    moved = re.search(r"moved (\d+) briefcases \((\d+) rows\)", run.stdout)
    assert moved is not None, run.stdout
    status = json.loads(run_cli(["moves", "status", str(cluster.path), "--json", "--limit", "100"]).stdout)
    (entry,) = [s for s in status["recent"] if s["kind"] == "reshard"]
    n, rows = int(moved.group(1)), int(moved.group(2))
    assert n > 0 and (entry["briefcases_done"], entry["briefcases_total"], entry["rows_done"], entry["rows_total"]) == (n, n, rows, rows)
    assert entry["params"]["map_backup"] == str(backup)
    rows_of_it = [s for s in status["recent"] if s["reshard_id"] == entry["move_id"]]
    assert sum(len(s["params"].get("gdids", [s["gdid"]])) for s in rows_of_it) == n, "each moved briefcase in one of its rows"
    assert len(status["recent"]) == len(rows_of_it) + 1, "--limit 100 must show the reshard and each of its moves"
    one = json.loads(run_cli(["moves", "status", str(cluster.path), "--json", "--limit", "1"]).stdout)
    assert [s["move_id"] for s in one["recent"]] == [entry["move_id"]], "the reshard finished last: it comes first"
    text = run_cli(["moves", "status", str(cluster.path), "--limit", "100"])
    assert text.returncode == 0 and f"{n}/{n}" in text.stdout and entry["move_id"] in text.stdout, (text.stdout, text.stderr)


@pytest.mark.slow  # 24 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_retried_move_is_counted_once(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first attempt of one move really aborts (--max-pause 0 on the real servers) and is
    retried; the reshard counts its finished moves only, so done = total = moves that finished.
    One briefcase per cutover (batch_pause=0); an aborted batch: tests/faults/test_reshard_batches.py."""
    from mdb.moves import reshard as reshard_mod

    real = reshard_mod.move_briefcase
    aborted: list[str] = []

    def first_attempt_aborts(*args: Any, **kwargs: Any) -> Any:
        if not aborted:
            try:
                return real(*args, **{**kwargs, "max_pause": 0.0})
            except MoveAbortedError as exc:
                aborted.append(str(exc.move_id))
                raise
        return real(*args, **kwargs)

    monkeypatch.setattr(reshard_mod, "move_briefcase", first_attempt_aborts)
    with cluster.store() as store:
        outcome = reshard_mod.reshard(store, "user", GDID(0, 0, 0), ["u1", "u2", "x"], map_path=cluster.path, batch_pause=0)
        journal = Journal(store)
        moves = journal.moves_of(str(outcome.reshard_id))
        entry = journal.get(str(outcome.reshard_id))
    assert aborted and [m.status for m in moves if m.move_id == aborted[0]] == ["aborted"]
    finished = [m for m in moves if m.status == "done"]
    assert entry is not None and len(moves) == len(finished) + 1
    assert (entry.briefcases_done, entry.briefcases_total, outcome.moved) == (len(finished),) * 3


@pytest.mark.slow  # 33 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_move_to_where_the_briefcase_is_only_says_so(cluster: Cluster) -> None:
    g = USERS[0]
    with cluster.store() as store:
        home = store.router.locate("user", g).server
    run = run_cli(["move", str(cluster.path), "user", str(g), "--to", home])
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"user/{g} already lives on {home}; nothing to do", run.stdout


@pytest.mark.slow  # 61 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_move_aborted_by_max_pause_exits_4(cluster: Cluster) -> None:
    """Needs the exit-code mapping of mdb/cli/app.py main() (helper "maptruth": RetryableError -> 4)."""
    assert issubclass(MoveAbortedError, RetryableError)
    g = USERS[0]
    with cluster.store() as store:
        home = store.router.locate("user", g).server
    run = run_cli(["move", str(cluster.path), "user", str(g), "--to", next(s for s in SERVERS if s != home), "--max-pause", "0"])
    assert "aborted" in run.stderr and "is still authoritative" in run.stderr, run.stderr
    assert run.returncode == 4, (run.returncode, run.stderr)


def test_workers_on_a_sqlite_central_are_refused_in_one_line(tmp_path: Path) -> None:
    """A SQLite file lets one writer in at a time, so its CENTRAL runs one worker: the command's own."""
    from support.moves import make_cluster

    urls = {name: f"sqlite:///{tmp_path / f'{name}.db'}" for name in ("c", "u1", "u2")}
    sqlite = make_cluster(urls, tmp_path, [("0:0:0", ["u1"])])
    worker = run_cli(["worker", str(sqlite.path)])
    assert worker.returncode == 2, (worker.returncode, worker.stderr)
    assert worker.stderr.strip() == "error: mdb worker needs a PostgreSQL CENTRAL: a SQLite CENTRAL runs one worker, `mdb reshard` itself"
    reshard = run_cli(["reshard", str(sqlite.path), "user", "--partition", "0:0:0", "--shards", "u1,u2", "--parallel", "0"])
    assert reshard.returncode == 2, (reshard.returncode, reshard.stderr)
    assert "--workers and --parallel 0 need a PostgreSQL CENTRAL" in reshard.stderr, reshard.stderr
