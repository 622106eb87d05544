"""`mdb demo-documents` end to end, and the secrets rule for MongoDB URLs."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.mongo import REAL_URI
from typer.testing import CliRunner

from mdb import Store
from mdb.cli import app
from mdb.errors import ServerUnavailableError
from mdb.mongo import MongoStore
from mdb.mongo.clients import MongoClients, database_name, is_mongo_url
from mdb.partition_map import parse_map


def test_demo_documents_runs_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if REAL_URI:
        monkeypatch.setenv("MDB_MONGO_URI", REAL_URI)
    else:
        monkeypatch.delenv("MDB_MONGO_URI", raising=False)
    result = CliRunner().invoke(app, ["demo-documents", "--dir", str(tmp_path / "d"), "--customers", "12"])
    assert result.exit_code == 0, result.output
    out = result.output
    if not REAL_URI:
        assert "in-process fake MongoDB" in out and "no MongoDB URI configured" in out
    assert "12 customers" in out
    assert "applied once each by the stats lock" in out
    deliveries, applied = (int(w) for w in out.split("payment events: ")[1].split(" applied")[0].replace(" deliveries,", "").split())
    assert deliveries == 2 * applied > 0
    assert "verified" in out and "(fence, refresh, retry)" in out


def test_urls_and_secrets() -> None:
    assert is_mongo_url(" MongoDB://h/x") and is_mongo_url("mongodb+srv://h/x") and not is_mongo_url("postgresql://h/x")
    assert database_name("mongodb://u:p@h:27017/shard_1?replicaSet=rs0") == "shard_1"
    assert database_name("mongodb://h") == "mdb"
    pmap = parse_map(
        "version: 1\nservers:\n  c: {primary: 'sqlite:///c.db'}\n"
        "  m: {primary: 'mongodb://app:s3cr3t-pw@db.invalid:1/x'}\n"
        "areas:\n  central: {kind: central, shards: [c]}\n  docs: {partitions: [{start: '0:0:0', shards: [m]}]}\n",
        "inline",
    )

    def refuse(url: str, **options: object) -> object:
        raise RuntimeError(f"cannot reach {url}")

    clients = MongoClients(pmap.servers, refuse)
    assert "s3cr3t" not in repr(clients) and "s3cr3t" not in clients.masked_url("m")
    with pytest.raises(ServerUnavailableError) as info:
        clients.client("m")
    assert "s3cr3t" not in str(info.value) and "***" in str(info.value)
    store = Store(pmap, types=[])
    MongoStore.attach(store, client_factory=refuse, types=[])
    assert "s3cr3t" not in repr(store.mongo)


def test_schema_apply_reports_an_unreachable_mongo_server_and_goes_on(tmp_path: Path) -> None:
    from mdb.testing.mongo import FakeMongo
    from mdb.schema import apply_schema

    fake = FakeMongo()

    def factory(url: str, **options: object) -> object:
        if "down" in url:
            raise RuntimeError(f"no route to {url}")
        return fake(url, **options)

    pmap = parse_map(
        f"version: 1\nservers:\n  c: {{primary: 'sqlite:///{tmp_path}/c.db'}}\n"
        "  up: {primary: 'mongodb://up/x'}\n  down: {primary: 'mongodb://u:hunter2@down/x'}\n"
        "areas:\n  central: {kind: central, shards: [c]}\n  docs: {partitions: [{start: '0:0:0', shards: [up, down]}]}\n",
        "inline",
    )
    store = Store(pmap, types=[])
    MongoStore.attach(store, client_factory=factory, types=[])
    reports = {r.server: r for r in apply_schema(store)}
    assert reports["c"].ok and reports["up"].ok and reports["up"].stamped == ["docs"]
    assert reports["down"].error is not None and "hunter2" not in reports["down"].error
    assert "unavailable" in reports["down"].error or "no route" in reports["down"].error
