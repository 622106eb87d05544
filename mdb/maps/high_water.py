"""High-water marks read from the live servers: what bounds the GDIDs that exist, per area.

:func:`mdb.maps.diff.diff_maps` accepts a new partition or range set only when it starts above
its area's mark, so the mark must cover every GDID stored anywhere (shards, relocation
targets, spare servers), every relocated one, and every one the CENTRAL sequences have handed
out but nobody stored yet. This module reads all of that through :class:`mdb.cluster.Cluster`
and knows nothing of applying a map.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection

from mdb.cluster import Cluster
from mdb.dberrors import translated
from mdb.errors import MapEditError
from mdb.gdid import GDID
from mdb.idgen import sequences

__all__ = ["high_water_marks", "stored_high_water"]

_MAX_V = GDID(2**32 - 1, 0, 2**60 - 1).sharding_value


def stored_high_water(conn: Connection, key_columns: Iterable[Any]) -> int | None:
    """The highest sharding value among the keys in ``key_columns`` (GDIDType columns), or None.

    Byte order (what ``max`` sees) is (era, authority, counter), but placement ignores the
    authority. So: the top era first, then the top key of each of the 16 authorities inside
    that era, each an index range probe on the key.
    """
    best: int | None = None
    for col in key_columns:
        # ORDER BY .. DESC LIMIT 1 rather than max(): PostgreSQL has no max(bytea), and both
        # servers answer it from the primary key index.
        top = conn.execute(select(col).order_by(col.desc()).limit(1)).scalar()
        if top is None:
            continue
        era = top.era
        probes = [
            select(col).where(col.between(GDID(era, a, 0), GDID(era, a, 2**60 - 1))).order_by(col.desc()).limit(1)
            .scalar_subquery().label(f"a{a}")
            for a in range(16)
        ]
        for k in conn.execute(select(*probes)).one():
            if k is not None and (best is None or k.sharding_value > best):
                best = k.sharding_value
    return best


def _issued_high_water(cluster: Cluster, scopes: Mapping[str, str]) -> dict[str, int]:
    """Per area, the highest GDID the CENTRAL sequences of its scope issued (or skipped past).

    Sequences (``mdb.idgen``) are named (scope, sequence) and know nothing of areas; a
    sequence serves an area when its scope is the area's name (``store.gdids(area, ...)``)
    or the scope ``scopes`` names for it. Its next free position minus one bounds every id
    it issued; blocks handed out but not yet stored are covered by that too.
    """
    by_scope: dict[str, str] = {scopes.get(area, area): area for area in cluster.router.area_names()}
    out: dict[str, int] = {}
    for server in cluster.router.central_servers():
        with cluster.transaction(server) as conn:
            if not sa_inspect(conn).has_table(sequences.name):
                continue
            rows = conn.execute(
                select(sequences.c.scope, sequences.c.era, sequences.c.next_counter).where(sequences.c.scope.in_(list(by_scope)))
            )
            for scope, era, next_counter in rows:
                v = int(era) * 2**60 + int(next_counter) - 1
                area = by_scope[scope]
                out[area] = max(out.get(area, 0), v)
    return out


def high_water_marks(cluster: Cluster, *, margin: int = 0, scopes: Mapping[str, str] | None = None) -> dict[str, GDID]:
    """The high-water mark of every partitioned area whose briefcase types ``cluster`` knows.

    The mark is the maximum of the root-table keys on every server that can hold the area's
    briefcases (its shards, relocation targets, spare servers), the relocation directory, and
    what the CENTRAL GDID sequences of the area's scope issued (``scopes`` maps an area to its
    sequence scope when that is not the area's name), plus ``margin`` counter values of
    headroom. An area without registered types is left out: its mark is unknown.
    """
    if margin < 0:
        raise MapEditError(f"the high-water margin must be >= 0, got {margin}")
    router = cluster.router
    used = {s for a in router.area_names() for s in router.area_servers(a)} | set(router.central_servers())
    spares = [s for s in cluster.map.servers if s not in used]
    best: dict[str, int] = {}
    per_server: dict[str, list[str]] = {}
    for area in router.area_names():
        if not cluster.types_of(area):
            continue
        best[area] = 0
        servers = [*router.area_servers(area), *spares]
        servers += [s for a, s in sorted(router.relocation_reach) if a == area]
        for server in dict.fromkeys(servers):
            per_server.setdefault(server, []).append(area)
    for (area, _), reach in router.relocation_reach.items():
        if area in best:
            best[area] = max(best[area], reach.high)
    for server, areas in per_server.items():
        with translated(server):
            conn = cluster.connect(server, readonly=False)
            try:
                existing = set(sa_inspect(conn).get_table_names())
                for area in areas:
                    cols = [bt.key_column(bt.tables[0]) for bt in cluster.types_of(area)
                            if bt.tables[0].name in existing]
                    top = stored_high_water(conn, cols)
                    if top is not None:
                        best[area] = max(best[area], top)
            finally:
                conn.close()
    for area, v in _issued_high_water(cluster, scopes or {}).items():
        if area in best:
            best[area] = max(best[area], v)
    return {area: GDID.from_sharding_value(min(v + margin, _MAX_V)) for area, v in best.items()}
