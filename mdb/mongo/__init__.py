"""Document briefcases on MongoDB servers (``mongodb://`` URLs in the map), through pymongo.

Same map, router, relocation directory and move journal as the SQL side; see docs/mongodb.md.
The in-process fake server for tests and the demo is :class:`mdb.testing.mongo.FakeMongo`.
"""

from mdb.mongo.clients import MongoClients, is_mongo_url, supports_transactions
from mdb.mongo.collection import BriefcaseCollection
from mdb.mongo.store import DocumentBriefcase, FanOutDocuments, MongoStore
from mdb.mongo.types import DocumentBriefcaseType, MongoIndex, registered_document_types

__all__ = [
    "BriefcaseCollection",
    "DocumentBriefcase",
    "DocumentBriefcaseType",
    "FanOutDocuments",
    "MongoClients",
    "MongoIndex",
    "MongoStore",
    "is_mongo_url",
    "registered_document_types",
    "supports_transactions",
]
