"""Cutting over many briefcases in one step: how a reshard moves thousands of them (issue 15).

Moved one at a time, each briefcase of a reshard pays for its own journal row, lock, copy
statements, checksums, fence, deletes, relocation entry and target state: some fifty round
trips across three servers, about 35 briefcases a second. A batch moves ``N`` briefcases that
share a source and a target with the round trips of one:

1. **one copy, before the lock**: the briefcases' ``incoming`` rows on the target, per table
   one ``COPY`` of all ``N`` briefcases' rows (read from one snapshot of the source), then the
   target's checksums by a query of their own; committed (sessions keep writing);
2. **one lock**: every briefcase's exclusive advisory lock on the source in one statement
   (tried without waiting and retried while sessions hold some; then one wait bounded by
   ``max_pause``). From here new write sessions of any of them wait;
3. **one statement on the source** (:func:`mdb.moves.batch_sql.fence_and_delete`): the ``N``
   fences and the deletes of their rows, returning the checksums of the rows it deleted;
   compared with the target's before anything commits. Briefcases written since the pre-copy
   differ: the statement is rolled back to its savepoint, they are copied and summed again in
   one target transaction, and the statement runs again;
4. **one commit point**: the source's commit;
5. **finalize**: the relocation entries (one write per CENTRAL shard), the ``N`` target
   states (one statement), the journal row ``done``.

Every guarantee of a single move holds per briefcase (docs/design.md invariant 3): sessions
never see a half-copied briefcase (``incoming`` on the target, the lock on the source), a stale
router meets the fence and refreshes, the write pause of a briefcase is the batch's lock time,
and the checksums of each side come from a query on that side, never from the copy's stream.
After a crash, resume decides by the fences, like for one move: the commit point is one
transaction, so either all ``N`` fences of the batch's id are on the source (finish) or none
(discard the ``N`` copies and restore the target's earlier state rows). A batch that cannot be
taken whole (a lock that does not come free, a checksum that differs, a pause over its bound)
is rolled back with the source authoritative and :class:`BatchAbortedError` says why; the
reshard then splits it (:mod:`mdb.moves.reshard`), down to single moves. A verification that
fails after the re-sync names every differing key per table and briefcase, like a single move's
report (``mismatches`` of the error, and the journal row's detail).

SQL servers only (PostgreSQL, SQLite): a document area's reshard moves one briefcase at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import text
from sqlalchemy.engine import Connection

from mdb import dberrors, telemetry
from mdb.cluster import Cluster
from mdb.dberrors import translated
from mdb.errors import BatchAbortedError, MdbError, MigrationError, MoveAbortedError, WorkerStoppedError
from mdb.faults import fault_point, register
from mdb.gdid import GDID
from mdb.migrations.revisions import SCHEMA_LOCK_KEY, current_revision, require_one_revision
from mdb.moves import cutover, verify
from mdb.moves.batch_sql import Blocks, Sums, claim_and_copy, fence_and_delete, resync, settle, target_holdings, undo
from mdb.moves.copy import AreaTable, is_postgres, measure
from mdb.moves.fencing import unchecked
from mdb.moves.gate import CutoverGate
from mdb.moves.journal import ABORTED, RUNNING, Journal, JournalEntry, new_move_id
from mdb.moves.lease import fenced_servers, hold
from mdb.moves.move import (
    DEFAULT_LOCK_WAIT, DEFAULT_MAX_PAUSE, BriefcaseMove, MoveOptions, MoveResult, ResumeOutcome, check_kinds, check_max_pause,
    refuse_if_busy, register_mover, register_resolver,
)
from mdb.moves.sql_steps import area_tables, check_target_schema, locked_briefcases, precheck, statement_cancelled
from mdb.system_tables import STATE_GONE
from mdb.urls import SQL

__all__ = ["BATCH_KIND", "BatchMove", "BatchResult", "SingleMove", "hold_schemas"]

log = logging.getLogger("mdb.moves.batch")

BATCH_KIND = "batch-move"
"""The journal kind of a batch's row (one row per batch, its briefcases in ``params['gdids']``)."""

FAULT_POINTS = register(
    "batch.after_journal_start",
    "batch.after_precopy",
    "batch.after_lock",
    "batch.after_source_cut",
    "batch.after_resync",
    "batch.after_verify",
    "batch.before_commit_point",
    "batch.after_commit_point",
)
"""A batch's crash points (tests SIGKILL a reshard at each, with writers running, then resume).

``after_resync`` is reached only by a batch with briefcases written between its pre-copy and its lock.
Finalize's and resume's (``batch.after_relocations``, ``batch.after_target_states``,
``batch.resume.after_discard``) are :mod:`mdb.moves.cutover`'s, passed by single moves too.
"""


@dataclass
class BatchResult:
    move_id: str
    gdids: list[GDID]
    rows: dict[GDID, dict[str, int]]
    """Verified rows per briefcase and table (what the commit point deleted on the source)."""
    pause_seconds: float

    @property
    def rows_per_table(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for per_table in self.rows.values():
            for name, n in per_table.items():
                out[name] = out.get(name, 0) + n
        return out


@contextmanager
def _locked_batch(cluster: Cluster, server: str, area: str, gdids: Sequence[GDID], *, lock_wait: float, max_pause: float) -> Iterator[tuple[Connection, float]]:
    """:func:`mdb.moves.sql_steps.locked_briefcases`; a lock that does not come free aborts the batch (it is split).

    No schema lock per batch: :func:`hold_schemas` holds it for the pass.
    """
    with ExitStack() as stack:
        try:
            conn, started = stack.enter_context(locked_briefcases(cluster, server, area, gdids, lock_wait=lock_wait, max_pause=max_pause))
        except MoveAbortedError as exc:
            raise BatchAbortedError(str(exc), None) from None
        yield conn, started


@contextmanager
def hold_schemas(cluster: Cluster, area: str, servers: Sequence[str], tables: Sequence[AreaTable],
                 revisions: dict[str, str | None] | None = None, *, doing: str = "reshard",
                 what: str | None = None) -> Iterator[frozenset[str]]:
    """Keep migrations off ``servers`` while batches run, check they are at one revision of ``area``,
    and yield the tables every one of them can sum by row hash (:func:`mdb.moves.verify.hashable_tables`).

    A single move takes each server's schema lock shared inside its own transactions and
    compares revisions every time; a batch would pay that on every cutover. Instead the
    reshard holds the lock shared at session level on one connection per PostgreSQL server for
    the whole pass (released when the block ends, or by the server when this process dies),
    so the revisions compared once here, and the column types the checksum was chosen by,
    cannot change under any batch of the pass. ``revisions``: those of servers already held
    (a worker holding more servers as it claims items of the pass), compared with these and
    updated with them. ``doing`` and ``what`` word a refusal (a single move: "move", its briefcase).
    """
    with ExitStack() as held:
        revisions = {} if revisions is None else revisions
        hashed: frozenset[str] | None = None
        conns: list[tuple[str, Connection]] = []
        for server in dict.fromkeys(servers):
            conn = held.enter_context(cluster.connect(server))
            with translated(server):
                if conn.dialect.name == "postgresql":
                    if not conn.execute(text("SELECT pg_try_advisory_lock_shared(:key)"), {"key": SCHEMA_LOCK_KEY}).scalar():
                        raise MigrationError(f"server {server!r}: a schema migration is running on it; {doing} after it ends")
                    held.callback(_unlock_schema, conn)
                revisions[server] = current_revision(conn, area)
            conns.append((server, conn))
        # Revisions first: between servers at different revisions the refusal names them and
        # `mdb migrate up`, not the columns that differ.
        require_one_revision(area, revisions)
        for server, conn in conns:
            with translated(server):
                # The live tables, not only the revision: a column added since the mover imported its
                # models would be copied as NULL (lost), so a pass refuses to start instead.
                check_target_schema(conn, server, list(tables), what or f"reshard pass of area {area!r}")
                here = verify.hashable_tables(conn, tables)
                hashed = here if hashed is None else hashed & here
                conn.commit()
        yield hashed or frozenset()


def _unlock_schema(conn: Connection) -> None:
    conn.rollback()
    conn.execute(text("SELECT pg_advisory_unlock_shared(:key)"), {"key": SCHEMA_LOCK_KEY})
    conn.commit()


def _differing(a: dict[tuple[str, GDID], verify.TableSum], b: dict[tuple[str, GDID], verify.TableSum]) -> list[GDID]:
    """Briefcases whose count or checksum of some table differs between two sides' sums."""
    return sorted({key[1] for key in a.keys() | b.keys() if a.get(key) != b.get(key)})


class BatchMove:
    """``gdids`` of ``area`` from ``source`` to ``target`` as one cutover (see the module docstring).

    Run inside :func:`hold_schemas` of both servers: a batch takes no schema lock of its own.
    """

    journal_kind: ClassVar[str] = BATCH_KIND

    def __init__(
        self, cluster: Cluster, journal: Journal, area: str, gdids: Sequence[GDID], source: str, target: str, *,
        reshard_id: str | None, tables: list[AreaTable] | None = None, max_pause: float = DEFAULT_MAX_PAUSE,
        lock_wait: float = DEFAULT_LOCK_WAIT, hashed: frozenset[str] = frozenset(), gate: CutoverGate | None = None,
        move_back: bool = False, item: str | None = None, single: bool = False, reverse_of: str | None = None,
        on_table: Callable[[str, int], None] | None = None, planned: dict[str, int] | None = None,
    ) -> None:
        if not gdids:
            raise MdbError("a batch needs at least one briefcase")
        self.cluster = cluster
        self.journal = journal
        self.area = area
        self.gdids = sorted(set(gdids))
        self.source = source
        self.target = target
        self.reshard_id = reshard_id
        self.tables = tables if tables is not None else area_tables(cluster, area)
        self.max_pause = max_pause
        self.lock_wait = lock_wait
        self.move_id = ""
        self.hashed = hashed
        """Tables both servers sum by row hash (what :func:`hold_schemas` yields); the others by md5."""
        self.gate = gate or CutoverGate()
        """Shared by the batches a pass runs at once (:mod:`mdb.moves.gate`); alone, it never waits."""
        self.move_back = move_back
        self.item = item
        """The reshard job's work item this batch belongs to (:mod:`mdb.moves.jobs`): its lease covers the batch."""
        """A cancel's move-back (journaled in its params: the cancel counts what it brought back by it)."""
        self.method: verify.Method = "sql"
        """How both sides sum rows; decided by the servers' kinds when the pre-copy connects to both."""
        self.single = single
        """An ``mdb move`` (a batch of one, :class:`SingleMove`): journals its steps (its history and
        `mdb fleet status` show them), holds a lease of its own unless a reshard's covers it, measures
        its bytes in the pre-copy, and names its bound ``--max-pause`` as the operator typed it."""
        self.reverse_of = reverse_of
        """The move of a cancelled reshard this one undoes (journaled; not counted as the reshard's progress)."""
        self.on_table = on_table
        self.planned = planned or {}
        """Rows per table counted before the batch (a single move's sizes): the journal row's totals."""
        self.bound = "--max-pause" if single else "max pause"
        self.blocks: Blocks = {}
        self.nbytes: dict[str, int] = {}
        """Bytes per table, measured on the source in the pre-copy's snapshot (a single move's result)."""

    def _precheck(self) -> dict[str, dict[str, Any]]:
        """Briefcases that cannot be batched (refused, the caller moves them singly); the target's earlier state rows.

        Read before anything is written: nothing needs undoing when this refuses. Checked again
        where it matters under the lock (the source's side) or made harmless by it (a copy
        commits with its ``incoming`` rows, so a second mover into the target fails on them).
        """
        refused: set[GDID] = set()
        with self.cluster.transaction(self.target) as conn:
            previous, held = target_holdings(conn, self.area, self.tables, self.gdids)
            refused.update(g for g, s in previous.items() if s["state"] != STATE_GONE)
            refused.update(held)
        if refused:
            raise BatchAbortedError(
                f"{len(refused)} briefcase(s) of the batch already have a state or rows on {self.target!r}", None, sorted(refused)
            )
        return {str(g): {"state": s["state"], "peer": s["peer"], "move_id": s["move_id"]} for g, s in previous.items()}

    def run(self) -> BatchResult:
        with self.gate.step():
            previous = self._precheck()
        self.move_id = new_move_id("batch")
        entry = JournalEntry(
            move_id=self.move_id, kind=BATCH_KIND, area=self.area, step="precopy" if self.single else "lock", status=RUNNING,
            gdid=self.gdids[0], source=self.source, target=self.target, reshard_id=self.reshard_id,
            params={"gdids": [str(g) for g in self.gdids], "max_pause": self.max_pause, "previous_target_states": previous,
                    **({"move_back": True} if self.move_back else {}), **({"item": self.item} if self.item else {}),
                    **({"reverse_of": self.reverse_of} if self.reverse_of else {})},
            briefcases_total=len(self.gdids), tables={name: [n, 0] for name, n in self.planned.items()},
            rows_total=sum(self.planned.values()),
        )
        self.journal.start(entry)
        fault_point("batch.after_journal_start")
        with ExitStack() as leased:
            if self.single and self.reshard_id is None and self.item is None:
                # An `mdb move` is driven under its own lease (a reshard's moves under the reshard's), so a
                # resume started beside it leaves it alone and `mdb moves status` names its process;
                # every write from here on checks its epoch (mdb.moves.fencing).
                lease = leased.enter_context(hold(self.journal, self.move_id))
                self.cluster = lease.fenced(self.cluster, fenced_servers(self.cluster, self.journal, entry))
                self.journal = Journal(self.cluster)
            return self._run(entry)
        raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow

    def _run(self, entry: JournalEntry) -> BatchResult:
        try:
            target_sums = self._precopy()
            fault_point("batch.after_precopy")
            if self.single:
                self.journal.step(self.move_id, "lock")
            with self.gate.cutting(), \
                    _locked_batch(self.cluster, self.source, self.area, self.gdids, lock_wait=self.lock_wait, max_pause=self.max_pause) as (src, locked_at):
                rows, pause = self._cut_over(src, locked_at, target_sums)
        except BatchAbortedError as exc:
            exc.move_id = self.move_id
            self._roll_back("; ".join([str(exc), *exc.mismatches]))  # the journal's history names the differing keys
            raise
        except WorkerStoppedError:  # Ctrl-C or SIGTERM, seen by the gate between two steps: never left half-cut
            self._roll_back("stopped before its commit point: the process was told to stop")
            raise
        except BaseException as exc:
            if statement_cancelled(exc):  # a statement under the write lock ran past max_pause
                why = f"a statement under the write lock was cancelled at {self.bound} {self.max_pause:.2f}s ({dberrors.describe(exc)})"
                self._roll_back(why)
                raise BatchAbortedError(why, self.move_id) from None
            # A server gone, a bug: the source transaction was rolled back; resume discards the copy.
            log.error("batch %s of %d briefcase(s) failed before its commit point (%s); the source is authoritative, "
                      "run `mdb moves resume` to discard the partial copy", self.move_id, len(self.gdids), type(exc).__name__)
            raise
        fault_point("batch.after_commit_point")
        per_table: dict[str, int] = {}
        for counts in rows.values():
            for name, n in counts.items():
                per_table[name] = per_table.get(name, 0) + n
        self.journal.pause(self.move_id, pause)  # the reshard's pause p99 in its history (mdb.moves.history)
        with self.gate.step(stoppable=False):  # past the commit point: a stop waits for it
            cutover.finalize(self.cluster, self.journal, entry, per_table, phases=self.single)
        for per_table in rows.values():
            telemetry.move_done(self.area, self.reshard_id, sum(per_table.values()), pause)
        return BatchResult(self.move_id, list(self.gdids), rows, pause)

    def _precopy(self) -> Sums:
        """Copy the batch to the target before the lock, behind committed ``incoming`` rows; the target's sums.

        Sessions on the source go on meanwhile; what they change is found under the lock by
        the checksums and copied again, briefcase by briefcase (:meth:`_cut_over`), so the write
        pause holds one statement and the commit, not the copy (how MongoDB's chunk migration
        and Vitess's VReplication cut over too). The source is read in one snapshot, so a
        parent and a child written between two tables' COPYs cannot arrive half. A crash from
        here on leaves a copy that resume discards (no fence on the source).
        """
        # The source is only read (one snapshot); the target's write is the one the fence check guards.
        with unchecked(self.cluster).transaction(self.source) as src, self.cluster.transaction(self.target) as dst:
            if src.dialect.name == "postgresql":
                src.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            self.method = verify.method_for(src, dst)
            if self.single:  # the result's bytes, in the copy's snapshot (summing row sizes reads every row)
                self.nbytes = {name: b for name, (_, b) in measure(src, self.tables, self.gdids[0]).items()}
            refused, sums, self.blocks = claim_and_copy(src, dst, self.area, self.tables, self.gdids, self.source, self.move_id,
                                                        self.hashed, self.gate, self.on_table)
            if refused:  # rolls both back: nothing of this batch was written
                raise BatchAbortedError(
                    f"{len(refused)} briefcase(s) of the batch were taken on {self.target!r} by another mover since the precheck "
                    f"(e.g. {refused[0]})", self.move_id, refused,
                )
        return sums

    def _cut_over(self, src: Connection, locked_at: float, target_sums: Sums) -> tuple[dict[GDID, dict[str, int]], float]:
        """Lock held: fence and delete on the source, compare its sums with the target's, copy again
        what changed since the pre-copy, commit. Returns the verified rows and the pause.

        Every round trip here is write pause: on the common path (nothing written since the
        pre-copy) one pipeline of settings, savepoint and statement, then the commit.
        """
        area, gdids, tables = self.area, self.gdids, self.tables
        deadline = locked_at + self.max_pause
        fault_point("batch.after_lock")
        cut = fence_and_delete(src, area, tables, gdids, self.target, self.move_id, self.method, deadline, self.hashed)
        fault_point("batch.after_source_cut")
        if cut.blocked:
            moving = sorted(cut.blocked)
            raise BatchAbortedError(
                f"under the lock {self.source!r} records {len(moving)} briefcase(s) of the batch as moving or gone "
                f"(e.g. {moving[0]}: another move?)", self.move_id, moving,
            )
        roots = [at.name for at in tables if at.pk == [at.key]]
        missing = sorted(g for g in gdids if not any((name, g) in cut.sums for name in roots))
        if missing:
            raise BatchAbortedError(
                f"under the lock {self.source!r} no longer holds {len(missing)} briefcase(s) of the batch (e.g. {missing[0]})",
                self.move_id, missing,
            )
        changed = _differing(cut.sums, target_sums)
        if changed:  # written since the pre-copy: copied again, summed again, and the source's statement run again
            undo(src)
            target_sums = self._resync(src, changed, cut.sums, target_sums, deadline)
            cut = fence_and_delete(src, area, tables, gdids, self.target, self.move_id, self.method, deadline, self.hashed)
            differ = _differing(cut.sums, target_sums)
            if differ:
                undo(src)  # the source's rows are back (still under the lock) for the report
                telemetry.move_verification_failed(area)
                raise BatchAbortedError(
                    "verification failed" if self.single else
                    f"verification of {len(gdids)} briefcase(s) found {len(differ)} that differ between {self.source!r} and "
                    f"{self.target!r} (e.g. {differ[0]}); every one is moved again on its own", self.move_id, differ,
                    self._mismatches(src, differ, cut.sums, target_sums),
                )
        fault_point("batch.after_verify")
        held = time.monotonic() - locked_at
        if held > self.max_pause:
            raise BatchAbortedError(f"the write lock was held {held:.2f}s, over {self.bound} {self.max_pause:.2f}s", self.move_id)
        if self.single:
            moved = {name: s.rows for (name, _), s in cut.sums.items()}
            self.journal.step(self.move_id, "commit_point", tables={n: [r, r] for n, r in moved.items()}, rows_done=sum(moved.values()))
        fault_point("batch.before_commit_point")
        src.commit()
        pause = time.monotonic() - locked_at
        rows: dict[GDID, dict[str, int]] = {g: {} for g in gdids}
        for (name, g), s in cut.sums.items():
            rows[g][name] = s.rows
        return rows, pause

    def _mismatches(self, src: Connection, differ: list[GDID], source_sums: Sums, target_sums: Sums) -> list[str]:
        """Every differing key of every table and briefcase whose sums differ, read on both sides
        (:func:`mdb.moves.verify.describe_mismatch`: the lines a single move reports)."""
        if is_postgres(src):
            src.exec_driver_sql("SET LOCAL statement_timeout = 0")  # the report may take its time
        out: list[str] = []
        with self.cluster.transaction(self.target) as dst:
            for g in differ:
                for at in self.tables:
                    mine, theirs = source_sums.get((at.name, g)), target_sums.get((at.name, g))
                    if mine != theirs:
                        out.append(verify.describe_mismatch(src, dst, at, g, self.method, mine.rows if mine else 0,
                                                            theirs.rows if theirs else 0))
        return out

    def _resync(self, src: Connection, changed: list[GDID], source_sums: Sums, target_sums: Sums, deadline: float) -> Sums:
        """Bring ``changed`` (written since the pre-copy) up to date on the target, row by row; the target's sums after.

        One target transaction: only the rows that differ are deleted and copied again
        (:func:`mdb.moves.batch_sql.resync`), then the briefcases are summed again by a query of
        their own. Committed before the source's commit point, like the pre-copy: a crash before
        that point leaves a copy resume discards.
        """
        again_of = set(changed)
        with self.cluster.transaction(self.target) as dst:
            settle(dst, deadline)
            redone = resync(src, dst, self.tables, changed, source_sums, target_sums, self.method, self.blocks)
            again = verify.batch_sums(dst, self.tables, changed, self.method, pinned=True, hashed=self.hashed)
        log.info("batch %s: re-synced %d changed row(s) under the lock", self.move_id, redone)
        fault_point("batch.after_resync")
        return {key: value for key, value in target_sums.items() if key[1] not in again_of} | again

    def _roll_back(self, why: str) -> None:
        entry = self.journal.get(self.move_id)
        assert entry is not None
        cutover.discard(self.cluster, entry, self.tables)
        self.journal.finish(self.move_id, ABORTED, why)
        telemetry.move_aborted(self.area, self.reshard_id)

    @classmethod
    def resume(cls, cluster: Cluster, journal: Journal, entry: JournalEntry, *, retry: bool = False) -> ResumeOutcome:
        """By the fences on the source, like every SQL cutover (:func:`mdb.moves.cutover.resume`).

        ``retry``: an ``mdb move`` (a batch of one of no reshard) rolled back is then taken again;
        a reshard's or job's batch belongs to it, which moves what the batch held again when it continues.
        """
        return cutover.resume(cluster, journal, entry, retry=retry)


register_resolver(BatchMove)


@register_mover
class SingleMove(BriefcaseMove):
    """A briefcase's move between two SQL servers (PostgreSQL, SQLite): ``mdb move``, a reshard's
    briefcase that no batch could take, a cancel's move back. A batch of one (docs/dev/0017).

    What only one briefcase needs is done here, before the batch: refusals worded for the move
    (a busy briefcase, a target already holding it, a source without it), the schemas held
    (:func:`hold_schemas` of both servers, refusing while a migration runs), its sizes (the
    CLI's progress bar) and a dry run. The cutover itself is :class:`BatchMove`'s, whose
    :class:`~mdb.errors.BatchAbortedError` is re-raised in the move's words.
    """

    server_kind: ClassVar[str] = SQL

    def __init__(self, cluster: Cluster, area: str, gdid: GDID, target: str, options: MoveOptions, journal: Journal | None = None) -> None:
        self.tables = area_tables(cluster, area)  # no type of the area: RoutingError first
        super().__init__(cluster, area, gdid, target, options, journal)

    def _result(self, move_id: str | None, status: str, tables: dict[str, tuple[int, int]], pause: float) -> MoveResult:
        return MoveResult(move_id, self.area, self.gdid, self.source, self.target, status, tables, pause, status == "done")

    def run(self) -> MoveResult:
        """Move the briefcase; raises :class:`MoveAbortedError` (source authoritative, copy removed) when rolled back."""
        o, cluster = self.options, self.cluster
        check_max_pause(o.max_pause)
        if self.source == self.target:
            return self._result(None, "already-there", {}, 0.0)
        check_kinds(cluster, self.area, self.gdid, self.source, self.target, self.server_kind)
        if o.reshard_id is None:
            refuse_if_busy(cluster, self.journal, self.area, self.gdid)
        with hold_schemas(cluster, self.area, [self.target, self.source], self.tables, doing="move", what=self.what) as hashed:
            with cluster.transaction(self.source) as conn:
                sizes = measure(conn, self.tables, self.gdid, with_bytes=o.dry_run)  # a move measures bytes in its pre-copy
            if o.on_sizes is not None:
                o.on_sizes(sizes)
            precheck(cluster, self.area, self.gdid, self.source, self.target, self.tables)
            if o.dry_run:
                return self._result(None, "dry-run", sizes, 0.0)
            batch = BatchMove(
                cluster, self.journal, self.area, [self.gdid], self.source, self.target, reshard_id=o.reshard_id, tables=self.tables,
                max_pause=o.max_pause, lock_wait=o.lock_wait, hashed=hashed, item=o.item, single=True, reverse_of=o.reverse_of,
                on_table=o.on_table, planned={name: n for name, (n, _) in sizes.items()},
            )
            try:
                done = batch.run()
            except BatchAbortedError as exc:
                reason = str(exc) if not exc.mismatches else f"{exc}: {'; '.join(exc.mismatches)}"
                raise MoveAbortedError(
                    f"move {exc.move_id} of {self.area}/{self.gdid} aborted and rolled back, {self.source!r} is still "
                    f"authoritative: {reason}", exc.move_id, exc.mismatches,
                ) from None
        if o.refresh:
            cluster.refresh()
        rows = done.rows[self.gdid]
        return self._result(done.move_id, "done", {at.name: (rows.get(at.name, 0), batch.nbytes.get(at.name, 0)) for at in self.tables},
                            done.pause_seconds)
