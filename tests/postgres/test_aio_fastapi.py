"""The FastAPI application of docs/async.md, run as written, on real PostgreSQL.

The code block after ``<!-- app.py -->`` in the doc is written to a file and imported; requests go
through httpx's ASGI transport with the app's lifespan running, so the doc cannot drift from
code that works.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from support.mapfiles import write_map
from sqlalchemy import select

from mdb.demo.models import User, UserBriefcase
from mdb.schema import apply_schema
from mdb.store import Store

DOC = Path(__file__).resolve().parents[2] / "docs" / "async.md"


def app_source() -> str:
    found = re.search(r"<!-- app\.py -->\n```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert found, "docs/async.md lost its app.py block"
    return found.group(1)


def test_the_fastapi_app_of_the_docs_runs_as_written(
    pg_databases: Callable[[int], list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = pg_databases(3)
    path = write_map(tmp_path, dict(zip(["central", "u1", "u2"], urls)), central=["central"], partitions=[("0:0:0", ["u1", "u2"])])
    data = yaml.safe_load(path.read_text())
    data["models"] = ["mdb.demo.models", "mdb.demo.repositories"]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with Store.from_yaml(path, types=[UserBriefcase]) as admin:
        assert all(r.ok for r in apply_schema(admin))
    (tmp_path / "app.py").write_text(app_source(), encoding="utf-8")
    monkeypatch.setenv("MDB_MAP", str(path))
    spec = importlib.util.spec_from_file_location("mdb_doc_app", tmp_path / "app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    app = module.app

    async def main() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                created = await client.post("/users", params={"email": "Ann@Example.com", "name": "Ann"})
                assert created.status_code == 200, created.text
                uid = created.json()["user_id"]
                assert (await client.post("/users", params={"email": "ann@example.com", "name": "Twin"})).status_code == 409
                assert (await client.get("/users/by-email/ANN@example.com")).json() == {"user_id": uid}
                renamed = await asyncio.gather(*(client.put(f"/users/{uid}/name", params={"name": f"Ann {i}"}) for i in range(10)))
                assert all(r.status_code == 200 for r in renamed)
                profile = (await client.get(f"/users/{uid}")).json()
                assert profile["email"] == "Ann@Example.com" and profile["name"].startswith("Ann ")
                assert (await client.get("/users/0:0:999999")).status_code == 404
                for malformed in ("nope", "1:2", "0:0:-1"):  # not a GDID: no such user, not a 500
                    assert (await client.get(f"/users/{malformed}")).status_code == 404
                    assert (await client.put(f"/users/{malformed}/name", params={"name": "x"})).status_code == 404

    asyncio.run(main())
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        rows = []
        for server in ("u1", "u2"):
            with store.transaction(server) as conn:
                rows += [(server, *r) for r in conn.execute(select(User.user_id, User.name))]
        assert len(rows) == 1 and rows[0][0] == store.router.locate("user", rows[0][1]).server
