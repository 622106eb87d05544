"""A move of one briefcase as an object: the driver every server kind shares (docs/design.md invariant 3).

:class:`Move` drives the steps in their order, journals the move's start, holds its lease,
passes its named fault points and reports telemetry; each step is a method the server kind
implements:

1. :meth:`Move.prepare`: what can be refused or answered before anything is journaled (busy
   briefcase, schemas, sizes, a dry run);
2. :meth:`Move.precheck`: the target can take the briefcase, the source holds it;
3. :meth:`Move.lock`: new write sessions of the briefcase wait on the source from here;
4. :meth:`Move.copy`: the target receives the briefcase behind an ``incoming`` state (sessions
   and fan-outs ignore it);
5. :meth:`Move.verify`: counts and checksums computed on each side separately;
6. :meth:`Move.commit_point`: the source's fence and deletion, one atomic step; before it the
   source is authoritative (:meth:`Move.roll_back` discards the copy), after it the target is;
7. :meth:`Move.finalize`: relocation directory, the target's state, journal ``done``.

After a crash :meth:`Move.resume` decides by the fence on the source, never by the journal
step: fence of this move there means finish, none means roll back.

One mover per server kind, chosen by the source server's kind (``pmap.kind_of``) through
:func:`register_mover`: :class:`mdb.moves.batch.SingleMove` (PostgreSQL, SQLite: a batch of
one, the batch engine's steps, docs/dev/0017) and :class:`mdb.moves.document_move.DocumentMove`
(MongoDB, a :class:`Move` registered by :func:`register_move`). A move between kinds is
refused. To add a server kind, write one mover in a module of its own and import it in
``mdb/moves/__init__.py``.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Protocol

from mdb import telemetry
from mdb.cluster import Cluster
from mdb.errors import MdbError, MoveAbortedError, RoutingError
from mdb.faults import fault_point
from mdb.gdid import GDID
from mdb.moves.journal import ABORTED, Journal, JournalEntry, new_move_id
from mdb.moves.lease import describe_liveness, fenced_servers, hold
from mdb.moves.sql_steps import area_tables, locked_source

__all__ = [
    "DEFAULT_LOCK_WAIT",
    "DEFAULT_MAX_PAUSE",
    "BriefcaseMove",
    "Move",
    "MoveOptions",
    "MoveResult",
    "Mover",
    "ResumeOutcome",
    "area_tables",
    "check_kinds",
    "check_max_pause",
    "locked_source",
    "move_briefcase",
    "move_class",
    "move_kinds",
    "register_move",
    "register_mover",
    "register_resolver",
    "resolve_move",
]

log = logging.getLogger("mdb.moves")

GONE: Final = "gone"
"""A reshard's or move-back's :class:`MoveResult` status for a briefcase the application deleted before it moved."""

DEFAULT_MAX_PAUSE = 5.0
DEFAULT_LOCK_WAIT = 30.0


@dataclass
class MoveResult:
    """What one move did, for every server kind (documents: per-collection counts in ``tables``)."""

    move_id: str | None
    area: str
    gdid: GDID
    source: str
    target: str
    status: str  # done | dry-run | already-there | gone (deleted by the application before it could move)
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)
    """table (or collection) -> (rows or documents, bytes; 0 where a kind does not measure bytes)."""
    pause_seconds: float = 0.0
    precopied: bool = False

    @property
    def rows(self) -> int:
        return sum(r for r, _ in self.tables.values())

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.tables.values())

    @property
    def documents(self) -> dict[str, int]:
        """Rows (documents) per table (collection): the counts a document move reports."""
        return {name: r for name, (r, _) in self.tables.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "move_id": self.move_id, "area": self.area, "gdid": str(self.gdid), "source": self.source,
            "target": self.target, "status": self.status, "rows": self.rows, "bytes": self.bytes,
            "tables": {k: {"rows": r, "bytes": b} for k, (r, b) in self.tables.items()},
            "pause_seconds": self.pause_seconds, "precopied": self.precopied,
        }


@dataclass
class ResumeOutcome:
    """What resume did with one unfinished journal entry, for every kind of entry."""

    move_id: str
    kind: str
    action: str  # finalized | rolled back | retried | reshard completed | cancel completed | failed | held
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"move_id": self.move_id, "kind": self.kind, "action": self.action, "detail": self.detail}


@dataclass(frozen=True)
class MoveOptions:
    """How to move. ``lock_wait``, ``on_table`` and ``on_sizes`` matter to SQL moves only."""

    max_pause: float = DEFAULT_MAX_PAUSE
    lock_wait: float = DEFAULT_LOCK_WAIT
    dry_run: bool = False
    reshard_id: str | None = None
    on_table: Callable[[str, int], None] | None = None
    on_sizes: Callable[[dict[str, tuple[int, int]]], None] | None = None
    refresh: bool = True
    source: str | None = None
    """A reshard passes the source it found the briefcase on; precheck confirms it."""
    reverse_of: str | None = None
    item: str | None = None
    """The work item of a reshard job this move belongs to (:mod:`mdb.moves.jobs`): its lease covers the move."""


def check_max_pause(max_pause: float) -> None:
    """A negative bound is a typo, not "no pause allowed" (that is 0: every cutover aborts)."""
    if not max_pause >= 0:  # also refuses NaN
        raise MdbError(f"max pause must be at least 0 seconds, got {max_pause!r}")


def refuse_if_busy(cluster: Cluster, journal: Journal, area: str, gdid: GDID) -> None:
    """Refuse a move of a briefcase that an unfinished move or reshard may still touch.

    An interrupted move leaves a copy on its target and a journal row that resume acts on; a
    second move started beside it would leave resume reasoning about the wrong source. A
    reshard plans its partition's briefcases up front; a move of one of them would race it.
    """
    partition = cluster.router.default_placement(area, gdid).partition_start
    busy = [
        f"{e.move_id}: {describe_liveness(journal, e)}" for e in journal.entries(unfinished=True)
        if e.area == area and (e.gdid == gdid or (e.kind == "reshard" and e.params.get("partition_start") == str(partition)))
    ]
    if busy:
        raise MdbError(
            f"briefcase {area}/{gdid} has unfinished moves or a reshard of its partition ({', '.join(busy)}): "
            "let a running one finish, or run `mdb moves resume MAP` for an interrupted one"
        )


def check_kinds(cluster: Cluster, area: str, gdid: GDID, source: str, target: str, server_kind: str) -> None:
    """Both servers are of ``server_kind``: a move between server kinds is refused, naming the one that differs."""
    for role, server in (("source", source), ("target", target)):
        kind = cluster.map.kind_of(server)  # an unknown server: RoutingError naming the known ones
        if kind != server_kind:
            raise RoutingError(
                f"move of {area}/{gdid}: {role} server {server!r} is a {kind} server, the briefcase lives on "
                f"{server_kind} servers (a move between server kinds is not supported)"
            )


class BriefcaseMove:
    """What every mover of one briefcase starts from, whatever its engine: the briefcase, where it
    is (the source the options name, or where the router places it) and where it goes."""

    def __init__(self, cluster: Cluster, area: str, gdid: GDID, target: str, options: MoveOptions, journal: Journal | None = None) -> None:
        self.cluster = cluster
        self.area = area
        self.gdid = gdid
        self.target = target
        self.options = options
        self.journal = journal or Journal(cluster)
        self.source = options.source or cluster.router.locate(area, gdid).server

    @property
    def what(self) -> str:
        """The move in the words of its refusals and errors."""
        return f"move of {self.area}/{self.gdid} from {self.source!r} to {self.target!r}"


class Move(BriefcaseMove, ABC):
    """One briefcase's move from its source server to ``target``; :meth:`run` takes every step once."""

    server_kind: ClassVar[str]
    """The server kind (:mod:`mdb.urls` constant) this implementation moves between."""
    journal_kind: ClassVar[str]
    """The journal's ``kind`` of its entries (``move``, ``mongo-move``)."""
    after_journal_start: ClassVar[str]
    after_commit_point: ClassVar[str]
    """The fault points the driver passes (registered by the implementation's module)."""

    def __init__(self, cluster: Cluster, area: str, gdid: GDID, target: str, options: MoveOptions, journal: Journal | None = None) -> None:
        super().__init__(cluster, area, gdid, target, options, journal)
        self.move_id = ""
        self.moved: dict[str, tuple[int, int]] = {}
        """What was moved, per table or collection: (rows, bytes); the result's ``tables``."""
        self.pause = 0.0
        self.precopied = False

    # -- the driver ------------------------------------------------------------------------

    def run(self) -> MoveResult:
        """Take every step (see the module docstring); raises :class:`MoveAbortedError` when rolled back."""
        check_max_pause(self.options.max_pause)
        if self.source == self.target:
            return self.result("already-there")
        check_kinds(self.cluster, self.area, self.gdid, self.source, self.target, self.server_kind)
        early = self.prepare()
        if early is not None:
            return early
        self.move_id = new_move_id(self.id_prefix())
        self.journal.start(self.journal_entry())
        fault_point(self.after_journal_start)
        # A single move is driven under its own lease (a reshard's moves under the reshard's), so
        # a resume started beside it leaves it alone and `mdb moves status` names its process.
        with hold(self.journal, self.move_id) if self.options.reshard_id is None else nullcontext() as lease:
            if lease is not None:  # its own lease: every write from here on checks its epoch (mdb.moves.fencing)
                self.cluster = lease.fenced(self.cluster, fenced_servers(self.cluster, self.journal, self.journal_entry()))
                self.journal = Journal(self.cluster)
            try:
                self.precheck()
            except MdbError as exc:
                self.journal.finish(self.move_id, ABORTED, f"precheck: {exc}")
                raise
            try:
                with self.locked_scope():  # left (the source's lock let go) before failed() runs
                    locked_at = time.monotonic()
                    self.lock()
                    self.copy()
                    self.verify()
                    self.commit_point()
                    if not self.pause:  # a kind that does not time its pause itself: lock to commit point
                        self.pause = time.monotonic() - locked_at
            except MoveAbortedError:
                raise
            except BaseException as exc:
                self.failed(exc)
                raise
            fault_point(self.after_commit_point)
            self.journal.pause(self.move_id, self.pause)  # before finalize: the history row of its finish has it
            self.finalize()
        if self.options.refresh:
            self.cluster.refresh()
        self.done()
        return self.result("done")

    def abort(self, reason: str, mismatches: list[str] | None = None) -> MoveAbortedError:
        """Roll the move back (before its commit point) and return the error to raise."""
        detail = reason if not mismatches else reason + ": " + "; ".join(mismatches)
        self.roll_back(detail)
        return MoveAbortedError(
            f"move {self.move_id} of {self.area}/{self.gdid} aborted and rolled back, {self.source!r} is still "
            f"authoritative: {detail}", self.move_id, mismatches,
        )

    def result(self, status: str) -> MoveResult:
        return MoveResult(
            self.move_id or None, self.area, self.gdid, self.source, self.target, status, dict(self.moved), self.pause, self.precopied,
        )

    # -- the steps -------------------------------------------------------------------------

    def id_prefix(self) -> str:
        """The move id's prefix (the journal kind, unless a kind keeps an older one)."""
        return self.journal_kind

    @abstractmethod
    def journal_entry(self) -> JournalEntry:
        """The journal row this move starts with (step ``precheck`` or the kind's first step)."""

    def prepare(self) -> MoveResult | None:
        """Checks before anything is journaled; a result ends the move there (a dry run)."""
        return None

    @abstractmethod
    def precheck(self) -> None:
        """Refuse, with the reason, a move that cannot be done safely (an MdbError aborts the journal row)."""

    @abstractmethod
    def lock(self) -> None:
        """From here new write sessions of the briefcase wait on the source."""

    @abstractmethod
    def copy(self) -> None:
        """Copy the briefcase to the target, behind its ``incoming`` state."""

    @abstractmethod
    def verify(self) -> None:
        """Compare counts and checksums of both sides; a difference raises :meth:`abort`'s error."""

    @abstractmethod
    def commit_point(self) -> None:
        """Fence and delete on the source, atomically: the target is authoritative from here."""

    def locked_scope(self) -> AbstractContextManager[Any]:
        """The scope of what :meth:`lock` holds in this process, around lock..commit_point.

        Left with the error, if any, so the lock's own context sees it (a SQL source
        transaction turns a driver error into the mdb error naming the server, and is
        rolled back unless :meth:`commit_point` committed it).
        """
        return nullcontext()

    def failed(self, exc: BaseException) -> None:
        """An unexpected error before the commit point; may raise :meth:`abort`'s error instead of ``exc``."""

    @abstractmethod
    def finalize(self) -> None:
        """After the commit point: relocation directory, target state, journal done. Idempotent."""

    @abstractmethod
    def roll_back(self, why: str) -> None:
        """Before the commit point: discard the target's copy, release the source, journal the end."""

    def done(self) -> None:
        """After a move finished: its rows and pause into the move metrics (:mod:`mdb.telemetry`), for every kind."""
        telemetry.move_done(self.area, self.options.reshard_id, sum(r for r, _ in self.moved.values()), self.pause)

    @classmethod
    @abstractmethod
    def resume(cls, cluster: Cluster, journal: Journal, entry: JournalEntry, *, retry: bool = False) -> ResumeOutcome:
        """Resolve an unfinished entry of this kind by the fence: past the commit point finish, before it roll back."""


class Resolver(Protocol):
    """What resume and cancel call for an unfinished journal row of one kind (a move class, a batch class)."""

    journal_kind: ClassVar[str]

    @classmethod
    def resume(cls, cluster: Cluster, journal: Journal, entry: JournalEntry, *, retry: bool = False) -> ResumeOutcome: ...


class Mover(Protocol):
    """What moves one briefcase between servers of one kind: a :class:`Move` subclass, or the SQL
    servers' batch of one (:class:`mdb.moves.batch.SingleMove`)."""

    server_kind: ClassVar[str]

    def __init__(self, cluster: Cluster, area: str, gdid: GDID, target: str, options: MoveOptions,
                 journal: Journal | None = None) -> None: ...

    def run(self) -> MoveResult: ...


_KINDS: dict[str, type[Mover]] = {}
_JOURNAL_KINDS: dict[str, type[Resolver]] = {}


def register_mover(cls: type[Mover]) -> type[Mover]:
    """Class decorator: ``cls`` moves briefcases between servers of ``cls.server_kind`` (its journal
    rows are resolved by whatever is registered for their kind)."""
    if cls.server_kind in _KINDS:
        raise MdbError(f"two move implementations for {cls.server_kind!r}: {_KINDS[cls.server_kind].__name__} and {cls.__name__}")
    _KINDS[cls.server_kind] = cls
    return cls


def register_resolver(cls: type[Resolver]) -> type[Resolver]:
    """``cls`` resolves unfinished journal rows of ``cls.journal_kind`` (a kind that is not a single move's)."""
    if cls.journal_kind in _JOURNAL_KINDS:
        raise MdbError(f"two resolvers for journal kind {cls.journal_kind!r}: {_JOURNAL_KINDS[cls.journal_kind].__name__} and {cls.__name__}")
    _JOURNAL_KINDS[cls.journal_kind] = cls
    return cls


def register_move(cls: type[Move]) -> type[Move]:
    """Class decorator: ``cls`` moves briefcases between servers of ``cls.server_kind`` and resolves its journal rows."""
    register_mover(cls)
    register_resolver(cls)
    return cls


def move_class(server_kind: str) -> type[Mover]:
    """The implementation moving briefcases between servers of ``server_kind``."""
    try:
        return _KINDS[server_kind]
    except KeyError:
        raise RoutingError(f"briefcases on {server_kind} servers cannot be moved (no move implementation)") from None


def move_kinds() -> dict[str, type[Resolver]]:
    """Journal kind -> implementation (resume and cancel pick by an entry's kind): single moves and batches."""
    return dict(_JOURNAL_KINDS)


def resolve_move(cluster: Cluster, journal: Journal, entry: JournalEntry, *, retry: bool = False) -> ResumeOutcome:
    """Finalize forward (commit point passed) or roll back one unfinished move, of any server kind.

    Counted in the move metrics like a move its own process ended (no pause: the write pause
    happened in the process that was interrupted, and was not measured to its end).
    """
    outcome = _JOURNAL_KINDS[entry.kind].resume(cluster, journal, entry, retry=retry)
    if outcome.action == "finalized":
        telemetry.move_resumed(entry.area, entry.reshard_id, "done", entry.rows_done)
    elif outcome.action in ("rolled back", "retried"):  # a retry is a new move, counted by itself
        telemetry.move_resumed(entry.area, entry.reshard_id, "aborted", 0)
    return outcome


def move_briefcase(
    store: Cluster,
    area: str,
    gdid: GDID,
    target: str,
    *,
    max_pause: float = DEFAULT_MAX_PAUSE,
    lock_wait: float = DEFAULT_LOCK_WAIT,
    dry_run: bool = False,
    reshard_id: str | None = None,
    journal: Journal | None = None,
    on_table: Callable[[str, int], None] | None = None,
    on_sizes: Callable[[dict[str, tuple[int, int]]], None] | None = None,
    refresh: bool = True,
    source: str | None = None,
    reverse_of: str | None = None,
    item: str | None = None,
) -> MoveResult:
    """Move one briefcase (every table or collection of every type of ``area``) to ``target``, online.

    The implementation is chosen by the kind of the server the briefcase lives on. Raises
    :class:`MoveAbortedError` (source still authoritative, target copy removed) when
    verification fails or the pause would exceed ``max_pause``. ``reverse_of`` names the move of
    a cancelled reshard this one undoes (journaled, so it is not counted as the reshard's progress).
    ``on_sizes`` gets the briefcase's rows per table once the schemas compared equal, before it
    moves (the CLI sizes its progress bar with it).
    """
    check_max_pause(max_pause)
    if refresh:
        store.refresh()
    source = source or store.router.locate(area, gdid).server
    options = MoveOptions(
        max_pause=max_pause, lock_wait=lock_wait, dry_run=dry_run, reshard_id=reshard_id,
        on_table=on_table, on_sizes=on_sizes, refresh=refresh, source=source, reverse_of=reverse_of, item=item,
    )
    cls = move_class(store.map.kind_of(source))
    return cls(store, area, gdid, target, options, journal).run()
