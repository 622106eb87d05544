"""Migrations: one additive revision over 100 shard databases on 2 PostgreSQL servers.

The revision adds a column with a server default and an index to a table of 20 rows (an
additive change, as most are). Measured, wall time of the whole rollout:

- ``mdb migrate up --parallel 1`` and ``--parallel 8`` (library call, as the CLI does it);
- the baseline a user writes without mdb: a shell loop running ``alembic upgrade head`` once
  per shard database (``alembic -c migrations/bench/alembic.ini -x url=URL upgrade head``, the
  env.py mdb writes into every history for exactly this).

Between runs the fleet is taken back down to the first revision (untimed), so each variant
does the same work. ``--quick``: 16 shards.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml
from sqlalchemy import create_engine

from benchmarks import BenchContext, Result
from mdb.migrations.fleet import migrate
from mdb.migrations.scripts import open_history
from mdb.store import Store
from mdb.system_tables import load_system_tables
from mdb.urls import sqlalchemy_url

SECTION = "migrate"
AREA = "bench"

REV1 = '''"""bench items"""
from alembic import op
import sqlalchemy as sa

revision = "r1"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("bench_items", sa.Column("item_id", sa.Integer(), primary_key=True), sa.Column("name", sa.String(100)))
    op.execute("INSERT INTO bench_items SELECT g, 'item ' || g FROM generate_series(1, 20) g")


def downgrade() -> None:
    op.drop_table("bench_items")
'''

REV2 = '''"""an additive change: a column with a default, and an index"""
from alembic import op
import sqlalchemy as sa

revision = "r2"
down_revision = "r1"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("bench_items", sa.Column("priority", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.create_index("ix_bench_items_priority", "bench_items", ["priority"])


def downgrade() -> None:
    op.drop_index("ix_bench_items_priority", table_name="bench_items")
    op.drop_column("bench_items", "priority")
'''


def _url(url: str) -> str:
    return sqlalchemy_url(url).render_as_string(hide_password=False)


def _fleet(ctx: BenchContext, shards: int) -> tuple[Path, list[str]]:
    """A map of CENTRAL + ``shards`` databases over 2 servers, CENTRAL's tables, and the history."""
    urls: list[str] = []
    while len(urls) < shards + 1:
        urls.extend(ctx.pg_urls(2))
    central, shard_urls = urls[0], urls[1 : shards + 1]
    folder = ctx.tmpdir / f"migrate-{shards}"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"s{i}" for i in range(shards)]
    data = {"version": 1, "servers": {"c": {"primary": central}, **{n: {"primary": u} for n, u in zip(names, shard_urls)}},
            "areas": {"central": {"kind": "central", "shards": ["c"]}, AREA: {"partitions": [{"start": "0:0:0", "shards": names}]}}}
    path = folder / "map.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    engine = create_engine(_url(central))
    with engine.begin() as conn:  # the Store reads the relocation directory and the map history there
        load_system_tables()[1].create_all(conn)
    engine.dispose()
    open_history(folder / "migrations", AREA, create=True)
    versions = folder / "migrations" / AREA / "versions"
    (versions / "r1.py").write_text(REV1, encoding="utf-8")
    (versions / "r2.py").write_text(REV2, encoding="utf-8")
    return path, shard_urls


def _mdb_up(path: Path, root: Path, parallel: int) -> float:
    """Wall time of a rollout by a fresh Store (no warm connections), as one CLI run does it."""
    start = time.perf_counter()
    with Store.from_yaml(path, types=[]) as store:
        run = migrate(store, root, to="r2", parallel=parallel)
    elapsed = time.perf_counter() - start
    if not run.ok:
        raise RuntimeError(f"migrate up failed: {[(r.server, r.detail) for r in run.failed]}")
    return elapsed


def _cli_up(path: Path, parallel: int) -> float:
    """Wall time of ``mdb migrate up MAP --parallel N`` as a process (Python start-up included)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from mdb.cli import main; main()", "migrate", "up", str(path), "--to", "r2",
                    "--parallel", str(parallel), "--json"], check=True, capture_output=True)
    return time.perf_counter() - start


def _back_to_r1(path: Path, root: Path) -> None:
    with Store.from_yaml(path, types=[]) as store:
        run = migrate(store, root, direction="down", to="r1", parallel=8)
    if not run.ok:
        raise RuntimeError(f"migrate down failed: {[(r.server, r.detail) for r in run.failed]}")


def _shell_loop(root: Path, urls: list[str]) -> float:
    """``for url in ...; do alembic ... upgrade head; done`` in bash, timed as a whole."""
    alembic = Path(sys.executable).parent / "alembic"
    ini = root / AREA / "alembic.ini"
    loop = "; ".join(f"{shlex.quote(str(alembic))} -c {shlex.quote(str(ini))} -x url={shlex.quote(_url(u))} upgrade head"
                     for u in urls)
    start = time.perf_counter()
    subprocess.run(["bash", "-e", "-c", loop], check=True, capture_output=True)
    return time.perf_counter() - start


def run(ctx: BenchContext) -> list[Result]:
    shards = 16 if ctx.quick else 100
    path, urls = _fleet(ctx, shards)
    root = path.parent / "migrations"
    with Store.from_yaml(path, types=[]) as store:
        migrate(store, root, to="r1", parallel=8)  # the table every variant then alters (untimed)
    timed: list[tuple[str, float]] = []
    for parallel in (1, 8):
        timed.append((f"mdb migrate up --parallel {parallel} (library)", _mdb_up(path, root, parallel)))
        _back_to_r1(path, root)
    timed.append(("mdb migrate up --parallel 8 (CLI process)", _cli_up(path, 8)))
    _back_to_r1(path, root)
    baseline = _shell_loop(root, urls)
    note = f"{shards} shard databases on 2 servers, one additive revision (column with default + index)"
    return [Result(SECTION, name, seconds, "s", "alembic upgrade head per shard, shell loop", baseline, note)
            for name, seconds in timed]
