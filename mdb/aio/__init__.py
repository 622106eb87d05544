"""mdb for asyncio applications: :class:`AsyncStore` (docs/async.md).

Importing it needs SQLAlchemy's asyncio extension (greenlet) and, for SQLite servers, aiosqlite.
"""

from mdb.aio.store import AsyncBriefcaseSession, AsyncCentral, AsyncGdids, AsyncStore

__all__ = ["AsyncBriefcaseSession", "AsyncCentral", "AsyncGdids", "AsyncStore"]
