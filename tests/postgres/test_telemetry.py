"""OpenTelemetry metrics and spans (mdb/telemetry.py, docs/observability.md).

The global OTel providers can be set once per process, so this module installs an SDK with an
in-memory metric reader and span exporter once (:func:`otel`) and every test reads *deltas*
of the cumulative counters around its own workload. mdb.telemetry was imported (by conftest,
through mdb) before the SDK is installed here, so every count these tests see also proves that
the API's proxy instruments pick up an SDK installed later.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.mapfiles import write_map
from support.moves import create_user, make_cluster
from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from mdb.demo.models import User, UserBriefcase
from mdb.demo.repositories import EmailIndex
from mdb.errors import MoveAbortedError, ServerUnavailableError
from mdb.gdid import GDID
from mdb.moves import batch_sql
from mdb.moves.move import move_briefcase
from mdb.moves.reshard import reshard
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.telemetry import SECONDS_BUCKETS
from support.telemetry import Otel, assert_no_gdid_or_key, otel, s  # noqa: F401 (fixtures: otel)
from support.telemetry import Series





@pytest.mark.postgres
def test_scripted_workload_records_exact_counts_and_no_gdid_label(
    otel: Otel, pg_databases: Callable[[int], list[str]], tmp_path: Path
) -> None:
    """n sessions, one error, one stale route, one cache miss then a verified hit, one move, one fan-out."""
    c, u1, u2 = pg_databases(3)
    cluster = make_cluster({"c": c, "u1": u1, "u2": u2}, tmp_path, [("0:0:0", ["u1"])])  # u2: a spare
    admin, stale = cluster.store(), cluster.store()
    try:
        # n write sessions, keys from a CENTRAL sequence (one GDID block).
        n = 4
        before = otel.values()
        users = [admin.new_gdid(UserBriefcase) for _ in range(n)]
        for g in users:
            create_user(admin, g)
        with pytest.raises(ZeroDivisionError), admin.briefcase(UserBriefcase, users[0]):
            1 / 0  # noqa: B018 - an application error inside the session
        got = otel.delta(before)
        assert got == {
            s("mdb.briefcase.sessions", area="user", server="u1", outcome="ok"): n,
            s("mdb.briefcase.sessions", area="user", server="u1", outcome="error"): 1,
            s("mdb.gdid.blocks", scope="user"): 1,
        }
        session_spans = [sp for sp in otel.finished_spans() if sp.name == "mdb.briefcase"][-(n + 1):]
        assert Counter((sp.attributes or {}).get("mdb.outcome") for sp in session_spans) == {"ok": n, "error": 1}

        # One move of users[0] to u2; ``stale`` routed before it and keeps the old route.
        stale.router  # noqa: B018 - load the relocation directory now, so it goes stale
        with admin.transaction("u1") as conn:
            rows = sum(
                conn.execute(select(func.count()).select_from(t).where(UserBriefcase.key_column(t) == users[0])).scalar_one()
                for t in UserBriefcase.tables
            )
        otel.spans.clear()
        before = otel.values()
        result = move_briefcase(admin, "user", users[0], "u2")
        got = otel.delta(before)
        assert result.status == "done" and result.rows == rows == 10
        moved = {k: v for k, v in got.items() if k[0].startswith("mdb.move")}
        assert moved == {
            s("mdb.moves", area="user", kind="move", outcome="done"): 1,
            s("mdb.move.rows", area="user", kind="move"): rows,
            s("mdb.move.pause.duration", area="user", kind="move"): 1,
        }
        assert otel.bounds("mdb.move.pause.duration") == {SECONDS_BUCKETS}  # seconds, not the SDK's millisecond default
        steps = [(sp.attributes or {}).get("mdb.move.step") for sp in otel.finished_spans() if sp.name == "mdb.move.step"]
        assert steps == ["precopy", "lock", "commit_point", "relocation", "target_state"]
        [move_span] = [sp for sp in otel.finished_spans() if sp.name == "mdb.move"]
        assert (move_span.attributes or {})["mdb.outcome"] == "done"
        assert all(sp.parent is not None and sp.parent.span_id == move_span.context.span_id
                   for sp in otel.finished_spans() if sp.name == "mdb.move.step")

        # The stale Store: refused on u1 (fenced), refreshed, retried on u2.
        before = otel.values()
        with stale.briefcase(UserBriefcase, users[0], readonly=True) as session:
            assert session.placement.server == "u2"
        assert otel.delta(before) == {
            s("mdb.ownership.refusals", area="user", server="u1", reason="stale_route"): 1,
            s("mdb.route.stale_retries", area="user", server="u1", reason="stale_route"): 1,
            s("mdb.briefcase.sessions", area="user", server="u2", outcome="ok"): 1,
        }

        # CENTRAL: the first lookup misses the cache, the second is a hit confirmed on the root.
        email = f"{users[1]}@example.com"
        admin.central.add(EmailIndex, email, users[1])
        before = otel.values()
        assert admin.central.lookup(EmailIndex, email) == users[1]
        assert otel.delta(before) == {s("mdb.central.cache.lookups", index="user_email", result="miss"): 1}
        before = otel.values()
        assert admin.central.lookup(EmailIndex, email) == users[1]
        assert otel.delta(before) == {
            s("mdb.central.cache.lookups", index="user_email", result="verified_hit"): 1,
            s("mdb.briefcase.sessions", area="user", server="u1", outcome="ok"): 1,  # the root probe
        }

        # A fan-out: one duration and one span per shard it read, no partial failure; the same
        # when every shard's pool is warm and one thread sends to all of them (mdb.scatter).
        for warm in (False, True):
            if warm:
                admin.fan_out("user", select(User.user_id))
            spans = len(otel.finished_spans())
            before = otel.values()
            out = admin.fan_out("user", select(User.user_id))
            assert sorted(r.user_id for r in out) == sorted(users)
            assert otel.delta(before) == {s("mdb.fanout.shard.duration", server=srv, outcome="ok"): 1 for srv in out.servers}
            shard_spans = [sp for sp in otel.finished_spans()[spans:] if sp.name == "mdb.fanout.shard"]
            assert sorted((sp.attributes or {})["mdb.server"] for sp in shard_spans) == sorted(out.servers)
            assert all(sp.start_time is not None and sp.end_time is not None and sp.start_time <= sp.end_time
                       for sp in shard_spans)
        assert otel.bounds("mdb.fanout.shard.duration") == {SECONDS_BUCKETS}

        keys = [str(g) for g in users] + [f"{g}@example.com" for g in users] + [email, email.casefold()]
        assert_no_gdid_or_key(otel.all_label_values(), keys)
        assert_no_gdid_or_key([v for sp in otel.finished_spans() for v in (sp.attributes or {}).values()], keys)
    finally:
        admin.close()
        stale.close()


@pytest.fixture
def sqlite_store(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> Iterator[tuple[Store, dict[str, str]]]:
    names = ["central", "a", "b"]
    urls = dict(zip(names, tmp_sqlite_urls(3), strict=True))
    path = write_map(tmp_path, urls, central=["central"], partitions=[("0:0:0", ["a", "b"])])
    store = Store.from_yaml(path, types=[UserBriefcase])
    assert all(r.ok for r in apply_schema(store))
    yield store, urls
    store.close()


def test_a_partial_fan_out_counts_the_missing_shard(otel: Otel, sqlite_store: tuple[Store, dict[str, str]]) -> None:
    store, urls = sqlite_store
    b_file = Path(urls["b"].removeprefix("sqlite:///"))
    store.engines.dispose()
    b_file.unlink()
    b_file.mkdir()  # a directory where the database file was: every connection to b fails
    before = otel.values()
    result = store.fan_out("user", select(User.user_id), allow_partial=True)
    assert [f.server for f in result.failed] == ["b"]
    assert otel.delta(before) == {
        s("mdb.fanout.shard.duration", server="a", outcome="ok"): 1,
        s("mdb.fanout.shard.duration", server="b", outcome="error"): 1,
        s("mdb.fanout.partial_failures", server="b"): 1,
    }
    before = otel.values()
    with pytest.raises(ServerUnavailableError):
        store.fan_out("user", select(User.user_id))
    assert s("mdb.fanout.partial_failures", server="b") not in otel.delta(before)  # not partial: it raised


def test_a_session_that_cannot_open_counts_as_an_error_without_a_server(
    otel: Otel, sqlite_store: tuple[Store, dict[str, str]]
) -> None:
    store, urls = sqlite_store
    gdid = GDID(0, 0, 7)
    home = store.router.locate("user", gdid).server
    path = Path(urls[home].removeprefix("sqlite:///"))
    store.engines.dispose()
    path.unlink()
    path.mkdir()
    before = otel.values()
    with pytest.raises(ServerUnavailableError), store.briefcase(UserBriefcase, gdid):
        pass
    assert otel.delta(before) == {s("mdb.briefcase.sessions", area="user", server="-", outcome="error"): 1}



def test_a_move_whose_copy_does_not_verify_counts_a_verification_failure(
    otel: Otel, sqlite_store: tuple[Store, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target copy is changed behind the move's back (in its pre-copy and again in the re-sync
    that repaired it, each in the target transaction that commits it): the move aborts, counted
    as aborted and as a verification failure, and no rows count as moved."""
    store, _ = sqlite_store
    gdid = store.new_gdid(UserBriefcase)
    create_user(store, gdid)
    target = "b" if store.router.locate("user", gdid).server == "a" else "a"

    def tampering(real: Callable[..., Any]) -> Callable[..., Any]:
        def copy(src: Connection, dst: Connection, *args: Any, **kwargs: Any) -> Any:
            out = real(src, dst, *args, **kwargs)
            dst.execute(update(User.__table__).where(User.__table__.c.user_id == gdid).values(name="tampered"))
            return out
        return copy

    monkeypatch.setattr(batch_sql, "copy_batch", tampering(batch_sql.copy_batch))  # the pre-copy
    monkeypatch.setattr(batch_sql, "apply_diffs", tampering(batch_sql.apply_diffs))  # the re-sync under the lock
    otel.spans.clear()
    before = otel.values()
    with pytest.raises(MoveAbortedError, match="verification failed"):
        move_briefcase(store, "user", gdid, target)
    assert {k: v for k, v in otel.delta(before).items() if k[0].startswith("mdb.move")} == {
        s("mdb.moves", area="user", kind="move", outcome="aborted"): 1,
        s("mdb.move.verification_failures", area="user"): 1,
    }
    [move_span] = [sp for sp in otel.finished_spans() if sp.name == "mdb.move"]
    assert (move_span.attributes or {})["mdb.outcome"] == "aborted"



def test_a_reshard_counts_its_moves_and_rows_as_kind_reshard(
    otel: Otel, tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path
) -> None:
    """A reshard's briefcase moves count under ``kind="reshard"`` (rate of mdb.move.rows: the
    reshard's rows/s), as many as the reshard reports, each with its pause."""
    urls = dict(zip(["central", "a", "b", "x"], tmp_sqlite_urls(4), strict=True))
    path = write_map(tmp_path, urls, central=["central"], partitions=[("0:0:0", ["a", "b"])])
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
        for _ in range(6):
            create_user(store, store.new_gdid(UserBriefcase), orders=1, lines=1)
        before = otel.values()
        outcome = reshard(store, "user", GDID(0, 0, 0), ["a", "b", "x"], map_path=path)
        moved = {k: v for k, v in otel.delta(before).items() if k[0].startswith("mdb.move")}
    assert outcome.moved > 0 and outcome.rows_moved == 4 * outcome.moved  # user, address, order, line
    assert moved == {
        s("mdb.moves", area="user", kind="reshard", outcome="done"): outcome.moved,
        s("mdb.move.rows", area="user", kind="reshard"): outcome.rows_moved,
        s("mdb.move.pause.duration", area="user", kind="reshard"): outcome.moved,
    }


SCRIPT = """
import sys
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from mdb import telemetry
from mdb.demo.models import UserBriefcase
from mdb.store import Store

store = Store.from_yaml(sys.argv[1], types=[UserBriefcase])
gdid = store.new_gdid(UserBriefcase)
before = type(store.briefcase(UserBriefcase, gdid)).__name__
with store.briefcase(UserBriefcase, gdid):
    pass
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
after = type(store.briefcase(UserBriefcase, gdid)).__name__
with store.briefcase(UserBriefcase, gdid):
    pass
points = [
    (dict(p.attributes), p.value)
    for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
    for m in sm.metrics if m.name == "mdb.briefcase.sessions" for p in m.data.data_points
]
home = store.router.locate("user", gdid).server
print(telemetry.sdk_installed(), before, after, points == [({"area": "user", "server": home, "outcome": "ok"}, 1)])
store.close()
"""


@pytest.mark.slow  # 27 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_without_an_sdk_the_session_is_not_wrapped_and_an_sdk_installed_later_counts(
    sqlite_store: tuple[Store, dict[str, str]], tmp_path: Path
) -> None:
    """In a fresh process (no SDK anywhere): the session path is the bare context manager; once a
    meter provider is set, the same Store's sessions are counted by the instruments mdb created
    at import (the API proxies pick the SDK up)."""
    import subprocess

    script = tmp_path / "later.py"
    script.write_text(SCRIPT, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "map.yaml")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "_BriefcaseBlock", "_ObservedSession", "True"]  # bare: the session block itself


def test_document_sessions_stale_route_and_fan_out_count_like_sql_ones_without_a_gdid_label(otel: Otel, mongo_env: Any) -> None:
    """The document side (fake MongoDB): sessions, one error, one stale route after a move, a fan-out and a count."""
    from support.mongo import UserDocs

    from mdb.mongo import MongoStore
    from mdb.moves.document_move import move_documents

    store = mongo_env.store(3)
    stale = Store.from_yaml(store.map_path, types=[])
    MongoStore.attach(stale, client_factory=mongo_env.factory, types=[UserDocs])
    try:
        users = [GDID(0, 0, i) for i in range(1, 5)]
        home = {g: store.router.locate("docs", g).server for g in users}
        before = otel.values()
        for g in users:
            with store.documents(UserDocs, g) as bc:
                bc.root.insert_one({"email": f"{g}@x"})
        with pytest.raises(ZeroDivisionError), store.documents(UserDocs, users[0], readonly=True):
            1 / 0  # noqa: B018 - an application error inside the context
        expected: Counter[Series] = Counter(s("mdb.briefcase.sessions", area="docs", server=home[g], outcome="ok") for g in users)
        expected[s("mdb.briefcase.sessions", area="docs", server=home[users[0]], outcome="error")] += 1
        assert otel.delta(before) == dict(expected)
        spans = [sp for sp in otel.finished_spans() if sp.name == "mdb.briefcase"][-5:]
        assert [(sp.attributes or {}).get("mdb.area") for sp in spans] == ["docs"] * 5

        # a move; ``stale`` routed before it is refused on the source (fenced), refreshes, retries on the target
        stale.router  # noqa: B018 - load the relocation directory now, so it goes stale
        source = home[users[0]]
        target = next(srv for srv in ("m1", "m2", "m3") if srv != source)
        before = otel.values()
        result = move_documents(store, UserDocs, users[0], target)
        moved = {k: v for k, v in otel.delta(before).items() if k[0].startswith("mdb.move")}
        assert result.rows == 1 and moved == {  # the move metrics of a document move are those of a SQL move
            s("mdb.moves", area="docs", kind="move", outcome="done"): 1,
            s("mdb.move.rows", area="docs", kind="move"): result.rows,
            s("mdb.move.pause.duration", area="docs", kind="move"): 1,
        }
        before = otel.values()
        with stale.documents(UserDocs, users[0], readonly=True) as bc:
            assert bc.placement.server == target
        assert otel.delta(before) == {
            s("mdb.ownership.refusals", area="docs", server=source, reason="stale_route"): 1,
            s("mdb.route.stale_retries", area="docs", server=source, reason="stale_route"): 1,
            s("mdb.briefcase.sessions", area="docs", server=target, outcome="ok"): 1,
        }

        # fan-out and count over documents: one duration per shard read
        before = otel.values()
        found = store.mongo.fan_out("docs", "users")
        assert len(found) == len(users)
        assert store.mongo.fan_out_count("docs", "users") == len(users)
        assert otel.delta(before) == {s("mdb.fanout.shard.duration", server=srv, outcome="ok"): 2 for srv in found.servers}

        keys = [str(g) for g in users] + [g.hex for g in users] + [f"{g}@x" for g in users]
        assert_no_gdid_or_key(otel.all_label_values(), keys)
        assert_no_gdid_or_key([v for sp in otel.finished_spans() for v in (sp.attributes or {}).values()], keys)
    finally:
        stale.close()
        store.close()


def test_moves_ended_by_resume_are_counted(otel: Otel, pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    """A move interrupted past its commit point and one before it: resume finishes one (done, its rows)
    and rolls the other back (aborted); no pause is recorded for either (it was not measured to its end)."""
    from mdb import faults
    from mdb.moves.resume import resume_all

    class Crash(Exception):
        pass

    c, u1, u2 = pg_databases(3)
    cluster = make_cluster({"c": c, "u1": u1, "u2": u2}, tmp_path, [("0:0:0", ["u1"])])
    store = cluster.store()
    try:
        past, before_point = store.new_gdid(UserBriefcase), store.new_gdid(UserBriefcase)
        for g in (past, before_point):
            create_user(store, g)
        with store.transaction("u1") as conn:  # the rows the move past its commit point carries
            rows = sum(
                conn.execute(select(func.count()).select_from(t).where(UserBriefcase.key_column(t) == past)).scalar_one()
                for t in UserBriefcase.tables
            )
        for g, point in ((past, "batch.after_commit_point"), (before_point, "batch.after_precopy")):
            def crash(name: str, point: str = point) -> None:
                if name == point:
                    raise Crash(name)

            faults.hook = crash
            try:
                with pytest.raises(Crash):
                    move_briefcase(store, "user", g, "u2")
            finally:
                faults.hook = None
        before = otel.values()
        outcomes = {o.action for o in resume_all(store)}
        assert outcomes == {"finalized", "rolled back"}
        moved = {k: v for k, v in otel.delta(before).items() if k[0].startswith("mdb.move")}
        assert moved == {
            s("mdb.moves", area="user", kind="move", outcome="done"): 1,
            s("mdb.moves", area="user", kind="move", outcome="aborted"): 1,
            s("mdb.move.rows", area="user", kind="move"): rows,
        }
    finally:
        store.close()
