"""The relocation directory: which briefcases live somewhere other than their default shard.

Kept in CENTRAL, one entry per relocated briefcase, sharded over the CENTRAL shards by the
GDID's 12 bytes like any CENTRAL key. Briefcase sessions never read it (they route by the map and
the fences they meet); a router reads it whole only when a tool asks for it (``router.relocations``,
``router.locate``), and fan-out reads only its summary per target server
(:func:`load_relocation_reach`). Correctness never depends on a copy being fresh, because every
session checks ownership on the shard itself (docs/design.md invariant 2).

Where the entries are kept (SQL rows, MongoDB documents) is the CENTRAL servers' backend's
business (:mod:`mdb.backends`); these functions are the directory's whole interface.
"""

from __future__ import annotations

from collections.abc import Mapping

from mdb.backends import Servers, backend_of
from mdb.gdid import GDID
from mdb.router import Reach, Router

__all__ = ["load_relocation_reach", "load_relocations", "relocation_of", "set_relocation", "set_relocations"]


def load_relocations(cluster: Servers, router: Router | None = None) -> dict[tuple[str, GDID], str]:
    """The whole directory, from every CENTRAL shard of ``router``'s map (default: the cluster's map).

    ``router`` is given by a refresh that is building a new router and must read the CENTRAL
    shards of the map it is switching to, not of the one it routes with.
    """
    router = Router(cluster.map) if router is None else router
    out: dict[tuple[str, GDID], str] = {}
    for server in router.central_servers():
        out.update(backend_of(router.map, server).load_relocations(cluster, server))
    return out


def relocation_of(cluster: Servers, area: str, gdid: GDID) -> str | None:
    """The directory entry of one briefcase (None: it lives on its default shard), read from the
    CENTRAL shard that owns its bytes: what `mdb where` needs, without the rest of the directory."""
    central = Router(cluster.map).locate_central(gdid).server
    return backend_of(cluster.map, central).relocation_of(cluster, central, area, gdid)


def load_relocation_reach(cluster: Servers, router: Router | None = None) -> dict[tuple[str, str], Reach]:
    """The directory summed up per (area, target server) over every CENTRAL shard: a few rows per
    server, never its entries (``router`` as for :func:`load_relocations`)."""
    router = Router(cluster.map) if router is None else router
    out: dict[tuple[str, str], Reach] = {}
    for server in router.central_servers():
        for key, reach in backend_of(router.map, server).relocation_reach(cluster, server).items():
            seen = out.get(key)
            out[key] = reach if seen is None else seen.merge(reach)
    return out


def set_relocation(cluster: Servers, area: str, gdid: GDID, server: str | None) -> None:
    """Record that ``area``/``gdid`` lives on ``server``; ``None`` removes the entry (back on its default shard).

    Written on the CENTRAL shard that owns the GDID's bytes, in its own unit of work: a move
    writes it after its commit point, and a crash before it is finished by resume.
    """
    set_relocations(cluster, area, {gdid: server})


def set_relocations(cluster: Servers, area: str, targets: Mapping[GDID, str | None]) -> None:
    """:func:`set_relocation` for many briefcases: one unit of work per CENTRAL shard they hash to.

    Idempotent, like the single form: a batched cutover finished by resume writes them again.
    """
    router = Router(cluster.map)  # pure: CENTRAL placement needs no relocations
    by_central: dict[str, dict[GDID, str | None]] = {}
    for gdid, server in targets.items():
        by_central.setdefault(router.locate_central(gdid).server, {})[gdid] = server
    for central, entries in by_central.items():
        backend_of(cluster.map, central).set_relocations(cluster, central, area, entries)
