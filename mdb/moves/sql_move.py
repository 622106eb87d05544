"""Moving one briefcase between SQL servers online: :class:`SqlMove` (docs/design.md invariant 3).

Order of a move, each step journaled before it is taken (``mdb.moves.journal``):

1. prechecks: both servers' tables match the models (mdb.schema_diff), target holds no row
   of the briefcase and no state row other than an old fence (a move back), source holds it;
2. optional pre-copy of a large briefcase outside the lock (committed on the target together
   with an ``incoming`` state row that keeps sessions away from it);
3. source transaction: the briefcase's EXCLUSIVE lock (PostgreSQL advisory lock on
   :func:`mdb.ownership.lock_key_sql`, which every session takes SHARED; SQLite: BEGIN
   IMMEDIATE). New sessions of the briefcase wait from here: the only pause;
4. copy (or re-sync after a pre-copy) to the target, committed there with the ``incoming`` row;
5. verify: counts and checksums per table computed separately on both sides, each by a query
   of its own on that server (never from the copy's stream). Between PostgreSQL servers the
   source's run on a second source connection while the copy runs (the lock keeps the
   briefcase still there), the target's after its commit;
6. commit point: in the locked source transaction, write the fence and delete the rows (behind
   a savepoint, while the target computes its checksums), then commit only if the checksums
   match and the delete removed exactly the verified number of rows per table; otherwise, or
   when the lock was held longer than ``max_pause``, it is rolled back;
7. finalize: relocation directory in CENTRAL, then the target's ``incoming`` row becomes
   ``resident`` (or disappears on the briefcase's default server), journal ``done``.

A crash before 6 leaves the source authoritative (resume discards the target copy); after 6
the fence proves the move happened and resume finishes 7. The driver (journal start, lease,
fault points, the order of the steps) is :class:`mdb.moves.move.Move`; this module holds the
SQL steps and the re-sync and checksum helpers they use. Finalize, discard and resume are
:mod:`mdb.moves.cutover`'s, the same code as a batch's (docs/dev/0017).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import replace
from typing import Any, ClassVar

from sqlalchemy.engine import Connection

from mdb import dberrors, telemetry
from mdb.cluster import Cluster
from mdb.faults import fault_point, register
from mdb.gdid import GDID
from mdb.moves import cutover, verify
from mdb.moves.copy import AreaTable, copy_rows, delete_keys, delete_rows, measure, select_keys
from mdb.migrations.revisions import lock_out_migrations
from mdb.moves.journal import ABORTED, RUNNING, Journal, JournalEntry
from mdb.moves.move import DEFAULT_MAX_PAUSE, Move, MoveOptions, MoveResult, ResumeOutcome, refuse_if_busy, register_move
from mdb.moves.sql_steps import (
    bound_statements,
    statement_cancelled,
    area_tables,
    check_schemas,
    locked_source,
    precheck,
    root_exists,
    set_state,
    state_row,
)
from mdb.system_tables import STATE_GONE, STATE_INCOMING
from mdb.urls import SQL, mask_secrets

__all__ = ["FAULT_POINTS", "PRECOPY_ROWS", "SqlMove"]

log = logging.getLogger("mdb.moves")

PRECOPY_ROWS = int(os.environ.get("MDB_PRECOPY_ROWS", "20000"))
"""Briefcases with at least this many rows are pre-copied outside the lock, then re-synced under it."""
VERIFY_WAYS = 2
"""Connections per side that compute a move's checksums at once (large tables in key ranges)."""

FAULT_POINTS = register(
    "move.after_journal_start",
    "move.after_precheck",
    "move.after_precopy",
    "move.after_lock",
    "move.during_copy",
    "move.after_copy_commit",
    "move.after_verify",
    "move.before_commit_point",
    "move.after_commit_point",
    "move.pause_abort.after_source_rollback",
)
"""The SQL move's crash points (tests SIGKILL a real move at each); finalize's and resume's are
:mod:`mdb.moves.cutover`'s, shared with the batch."""


def _resync(src: Connection, dst: Connection, tables: list[AreaTable], gdid: GDID, method: verify.Method) -> dict[str, int]:
    """Bring a pre-copied target up to date: only rows that differ are deleted and copied again.

    Python method: every row's digest from both sides. SQL method: see :func:`_resync_sql`.
    """
    diffs = []
    for at in tables:
        only_src, only_dst, different = verify.differing_keys(
            verify.row_digests(src, at, gdid, method), verify.row_digests(dst, at, gdid, method)
        )
        diffs.append((at, only_src + different, only_dst + different))
    return _apply_diffs(src, dst, gdid, diffs)


def _apply_diffs(
    src: Connection, dst: Connection, gdid: GDID, diffs: list[tuple[AreaTable, list[tuple[Any, ...]], list[tuple[Any, ...]]]],
) -> dict[str, int]:
    """(table, keys to copy, keys to delete), parents first: deletes children first, then copies parents first."""
    changed = {at.name: 0 for at, _, _ in diffs}
    for at, add, remove in diffs:
        changed[at.name] += len(set(add) | set(remove))
    for at, _, remove in reversed(diffs):
        delete_keys(dst, at, gdid, remove)
    for at, add, _ in diffs:
        select_keys(src, dst, at, gdid, add)
    return changed


RESYNC_BLOCK = 20_000
"""A re-sync compares key ranges of about this many rows (at most 64 per table) before rows.

Smaller ranges narrow down where rows changed but cost more: each range is an index scan and
an aggregate of its own (measured: 5,000-row ranges make summing 200k rows 1.7x slower).
"""


def _resync_blocks(src: Connection, tables: list[AreaTable], gdid: GDID, rows: dict[str, int]) -> list[verify.Part]:
    """Key ranges of about RESYNC_BLOCK rows (at most 64 per table) for a re-sync, bounds read on ``src``."""
    parts: list[verify.Part] = []
    for at in tables:
        block = max(RESYNC_BLOCK, -(-rows.get(at.name, 0) // 64))
        parts += verify.plan_parts(src, [at], gdid, rows, 1, block=block)
    return parts


def _resync_sql(
    src: Connection, dst: Connection, gdid: GDID, parts: list[verify.Part], target_sums: list[verify.TableSum],
) -> tuple[dict[str, int], list[verify.TableSum]]:
    """Re-sync between PostgreSQL servers, by key ranges: (changed rows per table, source sums of ``parts``).

    ``target_sums`` are the target's sums of ``parts`` taken right after the pre-copy committed
    (outside the lock: nothing changes a copy behind an ``incoming`` row). Under the lock only
    the source is summed again, and row digests are fetched only of the ranges that differ:
    the work under the lock follows what changed since the pre-copy, not the briefcase's size.
    Were the target changed all the same, the verification after the re-sync (which sums the
    target again) would catch it. The source sums, taken under the lock before anything is
    copied, are the source side of that verification.
    """
    src_sums = verify.part_sums(src, parts, gdid)
    order = list(dict.fromkeys(part.table.name for part in parts))
    diffs: dict[str, tuple[AreaTable, list[tuple[Any, ...]], list[tuple[Any, ...]]]] = {}
    for part in parts:
        diffs.setdefault(part.table.name, (part.table, [], []))
    for part, mine, theirs in zip(parts, src_sums, target_sums, strict=True):
        if mine != theirs:
            at, add, remove = diffs[part.table.name]
            only_src, only_dst, different = verify.differing_keys(
                verify.row_digests(src, at, gdid, "sql", part), verify.row_digests(dst, at, gdid, "sql", part)
            )
            add += only_src + different
            remove += only_dst + different
    return _apply_diffs(src, dst, gdid, [diffs[name] for name in order]), src_sums


def _table_sums_on(store: Cluster, server: str, tables: list[AreaTable], gdid: GDID, method: verify.Method) -> dict[str, verify.TableSum]:
    """Checksums of the briefcase on ``server``'s primary, in a read transaction of their own."""
    with store.transaction(server) as conn:
        return verify.table_sums(conn, tables, gdid, method)


SourceSide = tuple[list[verify.Part], list[verify.TableSum], dict[str, int]]


def _source_side(store: Cluster, source: str, tables: list[AreaTable], gdid: GDID, deadline: float, *, checksums: bool = True) -> SourceSide:
    """The locked source's checksum parts, their sums and the bytes per table (SQL method).

    On a connection of its own, beside the copy. Large tables are cut into VERIFY_WAYS key
    ranges so that the target can sum them on as many connections at once. Without
    ``checksums`` only the bytes (a re-sync has taken the source's sums already).
    """
    with store.transaction(source) as conn:
        bound_statements(conn, deadline)
        sizes = measure(conn, tables, gdid)
        nbytes = {name: b for name, (_, b) in sizes.items()}
        if not checksums:
            return [], [], nbytes
        parts = verify.plan_parts(conn, tables, gdid, {name: rows for name, (rows, _) in sizes.items()}, VERIFY_WAYS)
        return parts, verify.part_sums(conn, parts, gdid), nbytes


def _part_sums_on(store: Cluster, server: str, parts: list[verify.Part], gdid: GDID, deadline: float | None = None) -> list[verify.TableSum]:
    with store.transaction(server) as conn:
        if deadline is not None:
            bound_statements(conn, deadline)
        return verify.part_sums(conn, parts, gdid)


def _mismatches(
    store: Cluster, src: Connection, target: str, tables: list[AreaTable], gdid: GDID, method: verify.Method,
    bad: list[str], src_sums: dict[str, verify.TableSum], dst_sums: dict[str, verify.TableSum],
) -> list[str]:
    """Every differing key of every table whose checksums differ (for the abort message)."""
    out: list[str] = []
    with store.transaction(target) as dst:
        for name in bad:
            at = next(t for t in tables if t.name == name)
            src_rows = src_sums[name].rows if name in src_sums else 0
            dst_rows = dst_sums[name].rows if name in dst_sums else 0
            out.append(verify.describe_mismatch(src, dst, at, gdid, method, src_rows, dst_rows))
    return out


# -- the move ------------------------------------------------------------------------------------


@register_move
class SqlMove(Move):
    """A briefcase's move between two SQL servers (PostgreSQL or SQLite), step by step.

    The source transaction that holds the briefcase's lock is opened by :meth:`lock` and kept
    (with the pool computing checksums beside the copy) until :meth:`locked_scope` is left; :meth:`copy`,
    :meth:`verify` and :meth:`commit_point` work in it, so the only pause sessions see lasts
    from :meth:`lock` to :meth:`commit_point`.
    """

    server_kind: ClassVar[str] = SQL
    journal_kind: ClassVar[str] = "move"
    after_journal_start: ClassVar[str] = "move.after_journal_start"
    after_commit_point: ClassVar[str] = "move.after_commit_point"

    def __init__(self, cluster: Cluster, area: str, gdid: GDID, target: str, options: MoveOptions, journal: Journal | None = None) -> None:
        self.tables: list[AreaTable] = area_tables(cluster, area)  # no type of the area: RoutingError first
        super().__init__(cluster, area, gdid, target, options, journal)
        self.sizes: dict[str, tuple[int, int]] = {}
        self.previous: dict[str, Any] | None = None
        self.params: dict[str, Any] = {}
        self.precopy_sums: tuple[list[verify.Part], list[verify.TableSum]] | None = None
        self._held = ExitStack()
        self.src: Connection | None = None
        self.locked_at = 0.0
        self.deadline = 0.0
        self.pool: ThreadPoolExecutor | None = None
        self.method: verify.Method = "python"
        self.src_job: Future[SourceSide] | None = None
        self.resynced: tuple[list[verify.Part], list[verify.TableSum]] | None = None
        self.nbytes: dict[str, int] = {}
        self.cut: Any = None  # the savepoint behind which verify() writes the fence and the delete
        self.verified: dict[str, int] = {}
        self._copied_one = False

    @property
    def what(self) -> str:
        return f"move of {self.area}/{self.gdid} from {self.source!r} to {self.target!r}"

    def journal_entry(self) -> JournalEntry:
        return JournalEntry(
            move_id=self.move_id, kind=self.journal_kind, area=self.area, step="precheck", status=RUNNING, gdid=self.gdid,
            source=self.source, target=self.target, reshard_id=self.options.reshard_id,
            params={"max_pause": self.options.max_pause, "reverse_of": self.options.reverse_of,
                    **({"item": self.options.item} if self.options.item else {})},
            tables={name: [rows, 0] for name, (rows, _) in self.sizes.items()}, briefcases_total=1,
            rows_total=sum(r for r, _ in self.sizes.values()),
        )

    def prepare(self) -> MoveResult | None:
        store, o = self.cluster, self.options
        store.engines.spec(self.target)  # unknown server -> RoutingError naming the known ones
        if o.reshard_id is None:
            refuse_if_busy(store, self.journal, self.area, self.gdid)
            # A reshard compared every source and target before its first move (its prechecks).
            check_schemas(store, self.area, [self.target, self.source], self.tables, self.what)
        with store.transaction(self.source) as conn:
            self.sizes = measure(conn, self.tables, self.gdid, with_bytes=o.dry_run)  # a move measures bytes under the lock
        if o.on_sizes is not None:
            o.on_sizes(self.sizes)
        if o.dry_run:
            precheck(store, self.area, self.gdid, self.source, self.target, self.tables, "dry-run")
            self.moved = dict(self.sizes)
            return self.result("dry-run")
        return None

    def precheck(self) -> None:
        self.previous = precheck(self.cluster, self.area, self.gdid, self.source, self.target, self.tables, self.move_id)
        previous = self.previous
        self.params = {
            "max_pause": self.options.max_pause, "reverse_of": self.options.reverse_of,
            **({"item": self.options.item} if self.options.item else {}),
            "previous_target_state": None if previous is None else {
                "state": previous["state"], "peer": previous["peer"], "move_id": previous["move_id"]},
        }
        fault_point("move.after_precheck")
        precopy_rows = PRECOPY_ROWS if self.options.precopy_rows is None else self.options.precopy_rows
        self.precopied = sum(r for r, _ in self.sizes.values()) >= precopy_rows
        if not self.precopied:
            return
        # A large briefcase is copied once outside the lock (its 'incoming' row keeps sessions
        # away from the copy) and only re-synced under it.
        self.journal.step(self.move_id, "precopy", params=self.params)
        store = self.cluster
        with store.transaction(self.source) as src, store.transaction(self.target) as dst:
            lock_out_migrations(src, self.source)
            lock_out_migrations(dst, self.target)
            set_state(dst, self.area, self.gdid, STATE_INCOMING, self.source, self.move_id)
            copy_rows(src, dst, self.tables, self.gdid, on_table=self.options.on_table)
            blocks = _resync_blocks(src, self.tables, self.gdid, {name: r for name, (r, _) in self.sizes.items()}) \
                if verify.method_for(src, dst) == "sql" else None
        fault_point("move.after_precopy")
        if blocks is not None:  # the committed pre-copy, kept still by its 'incoming' row
            self.precopy_sums = (blocks, _part_sums_on(store, self.target, blocks, self.gdid))

    def lock(self) -> None:
        o = self.options
        if self.precopied:
            self.journal.step(self.move_id, "lock")
        else:
            self.journal.step(self.move_id, "lock", params=self.params)
        self.src, self.locked_at = self._held.enter_context(
            locked_source(self.cluster, self.source, self.area, self.gdid, lock_wait=o.lock_wait, max_pause=o.max_pause)
        )
        self.pool = self._held.enter_context(ThreadPoolExecutor(max_workers=VERIFY_WAYS, thread_name_prefix="mdb-move-verify"))
        fault_point("move.after_lock")
        self.deadline = self.locked_at + o.max_pause
        bound_statements(self.src, self.deadline)
        src_state = state_row(self.src, self.area, self.gdid)
        if (src_state is not None and src_state["state"] in (STATE_GONE, STATE_INCOMING)) or not root_exists(self.src, self.tables, self.gdid):
            raise self.abort("under the lock the source no longer holds the briefcase (another move?)")

    def locked_scope(self) -> ExitStack:
        """:meth:`lock` enters the source transaction, then the checksum pool, into this stack;
        leaving it shuts the pool down, then ends the transaction (rolled back unless committed)."""
        return self._held

    def _start_source_side(self, checksums: bool = True) -> None:
        """Sum the locked source on a second connection while the copy runs (SQL method only).

        From the lock on, no session can change the briefcase on the source, so its checksums
        (a query of their own, not the copy's stream) are computed beside the copy. For a large
        briefcase, started when the source has sent its largest table: the target is then busy
        for a while with that table's inserts and foreign-key checks while the source and this
        process are idle. The Python method is CPU-bound in this process, and SQLite wants one
        connection, so they sum in :meth:`verify`.
        """
        if self.src_job is None and self.method == "sql":
            assert self.pool is not None
            self.src_job = self.pool.submit(_source_side, self.cluster, self.source, self.tables, self.gdid, self.deadline, checksums=checksums)

    def _table_copied(self, name: str, rows: int) -> None:
        """A table's rows reached the target: the crash point after the first, then the caller's progress."""
        if not self._copied_one:
            self._copied_one = True
            fault_point("move.during_copy")
        if self.options.on_table is not None:
            self.options.on_table(name, rows)

    def copy(self) -> None:
        assert self.src is not None
        src, store, gdid = self.src, self.cluster, self.gdid
        self.journal.step(self.move_id, "copy")
        largest = max(self.sizes, key=lambda name: self.sizes[name][0])
        with store.transaction(self.target) as dst:
            bound_statements(dst, self.deadline)
            lock_out_migrations(dst, self.target)  # the source took it with the briefcase's lock
            self.method = verify.method_for(src, dst)
            if self.precopied or self.sizes[largest][0] < verify.SPLIT_ROWS:
                self._start_source_side(checksums=self.precopy_sums is None)  # a re-sync by ranges sums the source
            if self.precopied:
                state = state_row(dst, self.area, gdid)
                if state is None or state["move_id"] != self.move_id:
                    raise self.abort("the pre-copy on the target vanished")
                if self.precopy_sums is not None and self.method == "sql":
                    changed, src_part_sums = _resync_sql(src, dst, gdid, *self.precopy_sums)
                    self.resynced = (self.precopy_sums[0], src_part_sums)
                else:
                    changed = _resync(src, dst, self.tables, gdid, self.method)
                log.info("move %s: re-synced %d changed row(s) under the lock", self.move_id, sum(changed.values()))
            else:
                set_state(dst, self.area, gdid, STATE_INCOMING, self.source, self.move_id)
                copy_rows(src, dst, self.tables, gdid, on_table=self._table_copied,
                          on_streamed=lambda name: self._start_source_side() if name == largest else None)
                self._start_source_side()
        fault_point("move.after_copy_commit")
        if time.monotonic() > self.deadline:  # no use verifying a cutover that may not commit
            src.rollback()
            fault_point("move.pause_abort.after_source_rollback")
            raise self.abort(f"the copy alone held the write lock {time.monotonic() - self.locked_at:.2f}s, "
                             f"over --max-pause {self.options.max_pause:.2f}s")

    def verify(self) -> None:
        """Both sides' checksums; the target's run while the source writes the fence behind a savepoint.

        The fence and the delete are written (not committed) here, in the locked source
        transaction behind a savepoint: none of it is visible to anyone, and it is rolled back
        unless verification passes (:meth:`commit_point` commits it).
        """
        assert self.src is not None and self.pool is not None
        src, store, gdid, tables = self.src, self.cluster, self.gdid, self.tables
        self.journal.step(self.move_id, "verify")
        if self.src_job is None:
            src_sums = verify.table_sums(src, tables, gdid, self.method)
            self.nbytes = {name: b for name, (_, b) in measure(src, tables, gdid).items()}
            dst_sums = _table_sums_on(store, self.target, tables, gdid, self.method)
        else:
            parts, src_part_sums, self.nbytes = self.src_job.result()  # done before the copy, as a rule
            if self.resynced is not None:
                parts, src_part_sums = self.resynced  # taken under the lock before the re-sync copied
            src_sums = verify.combine(parts, src_part_sums)
            groups = verify.spread(parts, VERIFY_WAYS)
            dst_jobs = [self.pool.submit(_part_sums_on, store, self.target, [parts[i] for i in group], gdid, self.deadline) for group in groups]
        bound_statements(src, self.deadline)  # the time left, for the fence and the delete
        self.cut = src.begin_nested()
        set_state(src, self.area, gdid, STATE_GONE, self.target, self.move_id)
        deleted = delete_rows(src, tables, gdid)
        if self.src_job is not None:
            dst_part_sums: dict[int, verify.TableSum] = {}
            for group, job in zip(groups, dst_jobs, strict=True):
                dst_part_sums.update(zip(group, job.result(), strict=True))
            dst_sums = verify.combine(parts, [dst_part_sums[i] for i in range(len(parts))])
        bad = verify.compare(src_sums, dst_sums)
        # The delete must remove exactly the rows that were verified; anything else means
        # something wrote to the briefcase past its lock, and deleting would lose that write.
        wrong = [f"{name}: the commit point would delete {n} row(s), {src_sums[name].rows if name in src_sums else 'none'} were verified"
                 for name, n in deleted.items() if name not in src_sums or n != src_sums[name].rows]
        wrong += [f"{at.name}: not verified on the target" for at in tables if at.name not in dst_sums]
        if bad or wrong:
            self.cut.rollback()  # the source rows are back (still under the lock) for the report
            if src.dialect.name == "postgresql":
                src.exec_driver_sql("SET LOCAL statement_timeout = 0")  # the report may take its time
            telemetry.move_verification_failed(self.area)
            raise self.abort("verification failed", _mismatches(store, src, self.target, tables, gdid, self.method, bad, src_sums, dst_sums) + wrong)
        self.verified = {name: s.rows for name, s in src_sums.items()}
        fault_point("move.after_verify")

    def commit_point(self) -> None:
        assert self.src is not None
        held = time.monotonic() - self.locked_at
        if held > self.options.max_pause:
            self.src.rollback()
            fault_point("move.pause_abort.after_source_rollback")
            raise self.abort(f"the write lock was held {held:.2f}s, over --max-pause {self.options.max_pause:.2f}s")
        moved = self.verified
        self.journal.step(self.move_id, "commit_point", tables={n: [r, r] for n, r in moved.items()}, rows_done=sum(moved.values()))
        self.cut.commit()
        fault_point("move.before_commit_point")
        self.src.commit()
        self.pause = time.monotonic() - self.locked_at
        self.moved = {n: (r, self.nbytes.get(n, 0)) for n, r in moved.items()}

    def failed(self, exc: BaseException) -> None:
        if statement_cancelled(exc):
            # A statement under the lock ran past --max-pause (or an operator cancelled it): the
            # source transaction was rolled back when the lock was let go, so abort like any
            # cutover over its pause (the committed target copy, if any, is discarded).
            fault_point("move.pause_abort.after_source_rollback")
            raise self.abort(
                f"a statement under the write lock was cancelled at --max-pause {self.options.max_pause:.2f}s ({dberrors.describe(exc)})"
            ) from None
        # Anything else (a server going away, a bug): the source transaction was rolled back by
        # locked_source, so the source is authoritative; resume discards the target copy. The
        # error itself propagates (the CLI prints it; a bug keeps its traceback there), so this
        # line only adds what to do next.
        log.error("move %s of %s/%s failed before its commit point (%s: %s); the source is authoritative, "
                  "run `mdb moves resume` to discard the partial copy", self.move_id, self.area, self.gdid,
                  type(exc).__name__, mask_secrets(str(exc)))

    def finalize(self) -> None:
        cutover.finalize(self.cluster, self.journal, self.journal_entry(), self.verified, phases=True)

    def roll_back(self, why: str) -> None:
        cutover.discard(self.cluster, replace(self.journal_entry(), params=self.params), self.tables)
        self.journal.finish(self.move_id, ABORTED, why)
        telemetry.move_aborted(self.area, self.options.reshard_id)

    @classmethod
    def resume(cls, cluster: Cluster, journal: Journal, entry: JournalEntry, *, retry: bool = False) -> ResumeOutcome:
        """By the fence on the source, like every SQL cutover (:func:`mdb.moves.cutover.resume`); with
        ``retry``, a move of its own that was rolled back is then taken again."""
        outcome = cutover.resume(cluster, journal, entry)
        if outcome.action == "rolled back" and retry and entry.reshard_id is None:
            assert entry.gdid is not None and entry.target is not None
            options = MoveOptions(max_pause=float(entry.params.get("max_pause", DEFAULT_MAX_PAUSE)))
            cluster.refresh()
            result = cls(cluster, entry.area, entry.gdid, entry.target, options).run()
            return ResumeOutcome(entry.move_id, cls.journal_kind, "retried", f"rolled back, then moved again as {result.move_id}")
        return outcome
