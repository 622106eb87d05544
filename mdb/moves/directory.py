"""The one place moves write the relocation directory, and reach a cluster's document side.

The directory lives on CENTRAL: SQL tables (:mod:`mdb.relocations`) or, when the CENTRAL
servers are MongoDB servers, a collection (:mod:`mdb.mongo.central`). Every move kind writes
it through :func:`relocate`, so when one function covers both (``mdb.relocations.set_relocation``
taking a cluster) only this module changes.
"""

from __future__ import annotations

from mdb.cluster import Cluster
from mdb.errors import RoutingError
from mdb.gdid import GDID
from mdb.mongo.central import clear_relocation_mongo, set_relocation_mongo
from mdb.mongo.store import MongoStore
from mdb.relocations import clear_relocation, set_relocation
from mdb.urls import MONGO

__all__ = ["documents_of", "relocate"]


def documents_of(cluster: Cluster) -> MongoStore:
    """The cluster's MongoDB side (``Store.mongo``), typed; a cluster without one is refused.

    The :class:`~mdb.cluster.Cluster` interface does not (yet) name the document side, so it
    is read as the public ``mongo`` attribute and checked here, once.
    """
    mongo = getattr(cluster, "mongo", None)
    if not isinstance(mongo, MongoStore):
        raise RoutingError("this cluster serves no document briefcases (no MongoDB side attached)")
    return mongo


def relocate(cluster: Cluster, area: str, gdid: GDID, server: str | None) -> None:
    """Record that ``area``/``gdid`` lives on ``server`` (None: back on its default shard, no entry)."""
    central = cluster.router.locate_central(gdid).server
    if cluster.map.kind_of(central) == MONGO:
        mongo = documents_of(cluster)
        if server is None:
            clear_relocation_mongo(mongo, area, gdid)
        else:
            set_relocation_mongo(mongo, area, gdid, server)
        return
    with cluster.transaction(central) as conn:
        if server is None:
            clear_relocation(conn, area, gdid)
        else:
            set_relocation(conn, area, gdid, server)
