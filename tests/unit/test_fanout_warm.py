"""``Store.warm_up()``: a connection per shard is opened before the first request (issue 19)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from support.mapfiles import write_map

from mdb import Store
from mdb.demo.models import UserBriefcase
from mdb.schema import apply_schema


def test_warm_up_leaves_a_connection_in_every_pool_and_reports_an_unreachable_shard(
    tmp_path: Path, tmp_sqlite_urls: Callable[[int], list[str]]
) -> None:
    urls = tmp_sqlite_urls(3)
    missing = "postgresql+psycopg://postgres:s3cret-warm@127.0.0.1:1/nowhere"  # nothing listens on port 1
    path = write_map(tmp_path, {"c": urls[0], "u1": urls[1], "u2": urls[2], "gone": missing}, central=["c"],
                     partitions=[("0:0:0", ["u1", "u2"])])
    store = Store.from_yaml(path, types=[UserBriefcase])
    try:
        failed = store.warm_up()
        assert [f.server for f in failed] == ["gone"]
        assert "gone" in failed[0].error and "s3cret-warm" not in failed[0].error
        for server in ("c", "u1", "u2"):
            assert store.engine(server).pool.checkedin() == 1, server
        # An area: only its shards (routing reads CENTRAL, so the tables must exist now).
        reports = apply_schema(store)
        assert [r.server for r in reports if not r.ok] == ["gone"]
        assert store.warm_up("user") == []
    finally:
        store.close()
