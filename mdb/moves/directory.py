"""How moves reach a cluster's document side (the relocation directory is :mod:`mdb.relocations`)."""

from __future__ import annotations

from mdb.cluster import Cluster
from mdb.errors import RoutingError
from mdb.mongo.store import MongoStore

__all__ = ["documents_of"]


def documents_of(cluster: Cluster) -> MongoStore:
    """The cluster's MongoDB side (``Store.mongo``), typed; a cluster without one is refused.

    The :class:`~mdb.cluster.Cluster` interface does not (yet) name the document side, so it
    is read as the public ``mongo`` attribute and checked here, once.
    """
    mongo = getattr(cluster, "mongo", None)
    if not isinstance(mongo, MongoStore):
        raise RoutingError("this cluster serves no document briefcases (no MongoDB side attached)")
    return mongo
