"""The exception hierarchy of mdb.

Every error mdb raises on purpose derives from :class:`MdbError`, so an application can catch
"anything mdb refused" in one place. Errors caused by bad input also derive from ``ValueError``
because that is what they are to Python code that does not know mdb. Retryable conditions
(a stale route, a briefcase that is being moved) derive from :class:`RetryableError` so the
Store's retry loop and application code agree on what may be retried.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class MdbError(Exception):
    """Base of every error mdb raises on purpose."""

    sqlstate: str | None = None
    """The SQLSTATE of the database error this one was translated from (:mod:`mdb.dberrors`); None
    for an error mdb raised itself or a driver that gave none (SQLite, a refused connection)."""


class GDIDError(MdbError, ValueError):
    """A GDID could not be parsed or built; the message quotes the offending input."""


class MapError(MdbError, ValueError):
    """A partition map is invalid; the message names the file, the line where known, and the problem."""


class MapEditError(MapError):
    """A new map version would re-route existing data or otherwise breaks edit safety."""


class RoutingError(MdbError, LookupError):
    """A GDID or key cannot be placed: unknown area, below the first partition, and the like."""


class ServerUnavailableError(MdbError):
    """A server could not be reached; names the server (the URL is masked)."""

    def __init__(self, server: str, detail: str) -> None:
        super().__init__(f"server {server!r} is unavailable: {detail}")
        self.server = server


class AuthenticationError(MdbError):
    """A server refused the credentials (wrong password, unknown role, no pg_hba entry): names the server.

    Not a :class:`ServerUnavailableError`: the server is up and answered, and retrying with the
    same credentials fails forever, so the CLI exits 2 (refused), not 3 (retry later).
    """

    def __init__(self, server: str, detail: str) -> None:
        super().__init__(
            f"server {server!r} refused the credentials: {detail} (check the user and password of its URL in the map, "
            "or the environment variable / .pgpass it reads them from)"
        )
        self.server = server


class SchemaError(MdbError, TypeError):
    """A briefcase type or table is declared in a way that would break a briefcase invariant."""


class MigrationError(SchemaError):
    """A fleet migration cannot run or stopped (unknown area or revision, a server failed); says which server."""


class QueryError(MdbError, ValueError):
    """A statement mdb cannot run as asked, e.g. a fan-out whose result it cannot merge correctly."""


class DuplicateKeyError(MdbError, ValueError):
    """A unique CENTRAL index key is already taken (or being taken) by another briefcase."""

    def __init__(self, index: str, key: str, holder: object | None = None) -> None:
        held = f" by {holder}" if holder is not None else ""
        super().__init__(f"key {key!r} of CENTRAL index {index!r} is already taken{held}")
        self.index = index
        self.key = key
        self.holder = holder


class DuplicateRowError(DuplicateKeyError):
    """A write hit a primary key or unique constraint of a table on a server (a row with that key exists).

    A :class:`DuplicateKeyError`, so "this key is taken" is one ``except`` whether the key is a
    CENTRAL index key or a row's key; the driver's own IntegrityError never reaches the caller.
    """

    def __init__(self, server: str, table: str | None, key: str) -> None:
        where = f"table {table!r}" if table else "a table"
        MdbError.__init__(self, f"server {server!r}: {where} already has a row with {key} (a duplicate primary or unique key)")
        self.server = server
        self.table = table
        self.index = table or ""
        self.key = key
        self.holder = None


class CrossBriefcaseError(MdbError, ValueError):
    """A session tried to write a row that belongs to another briefcase."""


class RetryableError(MdbError):
    """The operation did not run and may be retried after refreshing routing."""


class LockTimeoutError(RetryableError):
    """A lock that mdb waits for (e.g. a reshard's freeze) stayed held past its timeout; nothing was changed.

    The message names the server and the sessions that held the lock; running the command again
    once they are gone succeeds, so the CLI exits 4.
    """

    def __init__(self, message: str, *, server: str) -> None:
        super().__init__(message)
        self.server = server


class StaleRouteError(RetryableError):
    """The shard a session was routed to no longer owns the briefcase (a fence or a re-stamp).

    ``moved_to`` is the server a fence names (the briefcase left for it): the retry goes there
    directly and checks ownership there, with no refresh (docs/design.md, "Routing state").
    """

    def __init__(self, message: str, moved_to: str | None = None) -> None:
        super().__init__(message)
        self.moved_to = moved_to


class BriefcaseMovingError(RetryableError):
    """The briefcase is in the middle of a move; retry after a short wait.

    ``refresh``: the retry re-reads the map first (a reshard's map apply is under way on the
    shard: it is stamped with a layout the process's map does not have yet, or no longer).
    """

    def __init__(self, message: str, refresh: bool = False) -> None:
        super().__init__(message)
        self.refresh = refresh


class MoveAbortedError(RetryableError):
    """A move stopped before its commit point (verification, ``--max-pause``); the source is still
    authoritative, so trying again later is safe. The CLI exits 4 (aborted safely, retry later)."""

    def __init__(self, message: str, move_id: str | None = None, mismatches: list[str] | None = None) -> None:
        super().__init__(message)
        self.move_id = move_id
        self.mismatches = mismatches or []


class BatchAbortedError(MoveAbortedError):
    """A batched cutover (mdb.moves.batch) was rolled back before its commit point: the source holds every briefcase of it.

    ``refused`` names the briefcases that cannot be batched at all (another move's state, a
    copy already on the target): the caller moves them one at a time, where the single move's
    precheck says exactly what is wrong.
    """

    def __init__(self, message: str, move_id: str | None, refused: Iterable[Any] = (), mismatches: list[str] | None = None) -> None:
        super().__init__(message, move_id, mismatches)
        self.refused: list[Any] = list(refused)
        """The GDIDs (typed loosely: this module imports nothing of mdb)."""


class MoveLeaseHeldError(MdbError):
    """Another live process drives this move or reshard (its lease); the message names it."""

    def __init__(self, move_id: str, holder: str) -> None:
        super().__init__(f"{move_id} is held by {holder}; only one process may drive it at a time")
        self.move_id = move_id
        self.holder = holder


class CancelError(MdbError, ValueError):
    """``mdb moves cancel`` of something that cannot be cancelled: unknown id, finished, past its map apply."""


class ReshardStoppedError(MdbError):
    """A reshard stopped between two moves because ``mdb moves cancel`` asked it to (or took it over)."""


class BriefcaseGoneError(MdbError):
    """The briefcase to move has no root row on its source: the application deleted it; there is nothing to move."""


class WorkerStoppedError(ReshardStoppedError):
    """This process was told to stop (Ctrl-C, SIGTERM): a worker stopped its batch at a step boundary, rolled back."""


class LeaseLostError(ReshardStoppedError):
    """A driver's lease was taken over (it was paused past it): a server refused its write by the lease's epoch."""


class StatsError(MdbError, ValueError):
    """A hot-data pattern asked to do something that would lose or double-count data (e.g. shrink K)."""


class FoldError(StatsError):
    """An event of a hot-data stream cannot be folded; names the stream, its briefcase and the event."""

    def __init__(self, message: str, *, stream: str, server: str, seq: int) -> None:
        super().__init__(message)
        self.stream = stream
        self.server = server
        self.seq = seq
        """The stream's latest snapshot number (the fold started from it)."""


class TransactionConflictError(RetryableError):
    """The database aborted the transaction to resolve a conflict (a deadlock, a serialization
    failure); nothing of it was committed, so re-running the whole transaction is safe."""

    def __init__(self, server: str, detail: str) -> None:
        super().__init__(f"server {server!r}: transaction aborted by a conflict, retry the whole transaction: {detail}")
        self.server = server


class CapacityError(RetryableError):
    """No connection to spare: a server refused one for capacity ("too many clients", SQLSTATE
    53300), or this process's connection budget stayed full for its whole wait.

    Not an outage: the server is up and answers, it is only full, so this is never a
    :class:`ServerUnavailableError`, and a fan-out with ``allow_partial`` raises it instead of
    listing the shard as failed (a full server would otherwise silently drop its rows). Retry
    later, or lower the connection budget (docs/operations.md).
    """

    def __init__(self, message: str, *, server: str | None = None, instance: str | None = None) -> None:
        super().__init__(message)
        self.server = server
        self.instance = instance


class FaultPointError(MdbError, ValueError):
    """A crash point registered twice, or passed without being registered (:mod:`mdb.faults`):
    a programming error, raised when the protocol module declaring it is imported."""
