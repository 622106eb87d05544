"""A reshard as a job in CENTRAL: its briefcases queued as work items that any worker claims.

The same queue carries the other jobs (a rebalance, a drain: :mod:`mdb.moves.movejob`; a
cancel's move-back, a pass of the reshard's own job); what follows says "reshard" for any of them.

A reshard used to live in one process (the operator's terminal) and move every batch itself.
Now each pass of its sweeps writes its planned moves to CENTRAL table ``mdb_job_items``, one row
per *work item*: up to :func:`item_briefcases` briefcases of one (source, target) pair. Any
worker (``mdb worker MAP`` on any host, the threads of ``mdb reshard`` itself) claims an item,
moves its briefcases in batched cutovers of the size its own sizer picks, and marks it done.

Claiming (:func:`claim`) is one CENTRAL transaction: on PostgreSQL the candidate rows are read
``FOR UPDATE SKIP LOCKED`` (claimers never queue on each other's rows), under a transaction
advisory lock that makes the per-server count exact; on SQLite, one writer at a time, the
transaction alone does it (and a SQLite CENTRAL runs one worker). An item is claimable when
nobody claimed it, or when its claimer's lease is gone (:mod:`mdb.moves.lease`: a dead pid on
this host, a beat older than ``lease_stale()`` from another host), and only while fewer than the
job's ``per_server`` items are in flight on each of its two servers.

**Each item is driven under a lease of its own** (lease id = item id): the claimer takes it
(a take increments its epoch), claims that epoch on CENTRAL, the source and the target
(:mod:`mdb.moves.fencing`), and makes every write of the item through that fenced cluster. A
worker SIGSTOPped past its lease on one host is taken over by a worker on another; the stale
worker's writes are then refused on every server (DESIGN.md invariant 7). The batches and
single moves of an item are journaled under the reshard (``reshard_id``) with ``params['item']``,
so :func:`mdb.moves.lease.lease_owner_id` names the item's lease for them: ``mdb moves resume``
taking the reshard's lease never touches a batch a live worker drives. A worker that takes an
item over first resolves its predecessor's unfinished entries (commit point passed: finished;
not: the target copy discarded) and then moves what is left.

**The job's own phases** (plan, sweeps, freeze, map apply, cleanup) run in whichever process
holds the reshard's lease: ``mdb reshard`` (which enqueues the job and works on it too) or,
once that process is gone, the first ``mdb worker`` that finds the job without a live holder.
Before a holder plans (at its start), it settles the items earlier holders left
(:func:`settle`): waits for live workers to finish theirs, resolves those of dead workers, and
drops the rest, so a briefcase is never in two items that are worked at once.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Final

from sqlalchemy import BigInteger, Column, DateTime, Integer, String, Table, Text, delete, func, insert, select, update

from mdb.cluster import Cluster
from mdb.dialects import sql_dialect
from mdb.errors import MdbError
from mdb.gdid import GDID
from mdb.moves.journal import RUNNING, Journal, moves_table
from mdb.moves.lease import Holder, holders_in, me
from mdb.moves.plan import PlannedMove
from mdb.system_tables import central_metadata

__all__ = [
    "item_briefcases", "Item", "ItemResult", "WorkerRow", "claim", "enqueue", "finish_item", "item_servers", "item_state",
    "done_since", "drop", "forget", "give_back", "progress_item", "results_of", "job_items", "last_pass", "count_open", "open_items", "release_item", "settle", "stop_items", "workers",
]

log = logging.getLogger("mdb.moves.jobs")


def item_briefcases() -> int:
    """Briefcases per work item: several batches' worth (a batch aims at ~25 ms, 60-80 briefcases of 100
rows), so a claim's round trips are paid rarely, and few enough that the workers share a pass.
``MDB_ITEM_BRIEFCASES`` overrides it (tests cut a small reshard into many items), read when used;
a value that is not a whole number of at least 1 is refused naming the variable."""
    raw = os.environ.get("MDB_ITEM_BRIEFCASES")
    if not raw:
        return 200
    try:
        value = int(raw)
    except ValueError:
        raise MdbError(f"MDB_ITEM_BRIEFCASES={raw!r} is not a whole number of briefcases") from None
    if value < 1:
        raise MdbError(f"MDB_ITEM_BRIEFCASES={raw!r} must be at least 1")
    return value


DEFAULT_PER_SERVER: Final = 2
"""Items in flight at once on one server (as source or target), over every worker of every host."""
CLAIM_SETTLE: Final = 10.0
"""Seconds a claimed item whose claimer has not taken its lease yet still counts as claimed."""
CLAIM_LOCK_KEY: Final = 0x6D64625F6A6F6273 & 0x7FFFFFFFFFFFFFFF
"""The transaction advisory lock claims take on a PostgreSQL CENTRAL ('mdb_jobs')."""

PENDING: Final = "pending"
DONE: Final = "done"
STOPPING: Final = "stopping"
"""The job stopped (cancel, its holder interrupted): the claimer stops after its batch in hand."""
DROPPED: Final = "dropped"
"""Not moved by this item; the next holder's plan finds whatever of it is left."""

job_items = Table(
    "mdb_job_items",
    central_metadata,
    Column("item_id", String(64), primary_key=True),
    Column("job_id", String(64), nullable=False, index=True),
    Column("pass_no", Integer, nullable=False),
    Column("seq", Integer, nullable=False),
    Column("source", String(63), nullable=False),
    Column("target", String(63), nullable=False),
    Column("gdids", Text, nullable=False),
    Column("rows_planned", BigInteger, nullable=False, default=0),
    Column("status", String(16), nullable=False, index=True),
    Column("worker", String(300), nullable=True),
    Column("attempts", Integer, nullable=False, default=0),
    Column("claimed_at", DateTime(timezone=True), nullable=True),
    Column("result", Text, nullable=True),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
)

_ensured: set[str] = set()


def _ensure(journal: Journal) -> None:
    key = journal.store.engine(journal.server).url.render_as_string(hide_password=True)
    if key in _ensured:
        return
    with journal.store.transaction(journal.server) as conn:
        job_items.create(conn, checkfirst=True)
    _ensured.add(key)


@dataclass
class Item:
    item_id: str
    job_id: str
    pass_no: int
    source: str
    target: str
    gdids: list[GDID]
    status: str
    attempts: int
    worker: str | None = None
    rows_planned: int = 0

    @classmethod
    def from_row(cls, row: Any) -> Item:
        return cls(row["item_id"], row["job_id"], int(row["pass_no"]), row["source"], row["target"],
                   [GDID.parse(g) for g in json.loads(row["gdids"])], row["status"], int(row["attempts"]), row["worker"],
                   int(row["rows_planned"] or 0))


@dataclass
class ItemResult:
    """What an item moved: briefcases moved, those the application deleted first, rows per table."""

    moved: list[GDID] = field(default_factory=list)
    gone: list[GDID] = field(default_factory=list)
    tables: dict[str, int] = field(default_factory=dict)

    def add(self, gdids: Sequence[GDID], tables: dict[str, int]) -> None:
        self.moved.extend(gdids)
        for name, n in tables.items():
            self.tables[name] = self.tables.get(name, 0) + n

    def to_json(self) -> str:
        return json.dumps({"moved": [str(g) for g in self.moved], "gone": [str(g) for g in self.gone], "tables": self.tables})

    @classmethod
    def from_json(cls, raw: str | None) -> ItemResult:
        data = json.loads(raw or "{}")
        return cls([GDID.parse(g) for g in data.get("moved", [])], [GDID.parse(g) for g in data.get("gone", [])],
                   dict(data.get("tables", {})))


def enqueue(journal: Journal, job_id: str, pass_no: int, moves: Sequence[PlannedMove], size: int | None = None) -> list[str]:
    """Queue ``moves`` as items of ``job_id``'s pass ``pass_no``: per (source, target) pair, in plan order, pairs in turn."""
    _ensure(journal)
    size = max(1, item_briefcases() if size is None else size)
    groups: dict[tuple[str, str], list[PlannedMove]] = {}
    for m in moves:
        groups.setdefault((m.source, m.target), []).append(m)
    chunks = [[g[i:i + size] for i in range(0, len(g), size)] for g in groups.values()]
    rows: list[dict[str, Any]] = []
    for turn in range(max((len(c) for c in chunks), default=0)):
        for pair in chunks:
            if turn < len(pair):
                part = pair[turn]
                rows.append({"item_id": f"item-{uuid.uuid4().hex[:16]}", "job_id": job_id, "pass_no": pass_no, "seq": len(rows),
                             "source": part[0].source, "target": part[0].target, "gdids": json.dumps([str(m.gdid) for m in part]),
                             "rows_planned": sum(m.total_rows for m in part), "status": PENDING, "attempts": 0})
    if rows:
        with journal.store.transaction(journal.server) as conn:
            conn.execute(insert(job_items), rows)
    return [r["item_id"] for r in rows]


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _live_claims(conn: Any, rows: Sequence[Any]) -> tuple[set[str], dict[str, Holder]]:
    """Of claimed item rows: those whose claimer is alive (its lease held by a live process, or just claimed)."""
    holders = holders_in(conn, [r["item_id"] for r in rows])
    live: set[str] = set()
    for r in rows:
        holder = holders.get(r["item_id"])
        if holder is not None:
            if holder.alive or holder.mine:
                live.add(r["item_id"])
        elif r["claimed_at"] is not None and (_utc(r["now"]) - _utc(r["claimed_at"])).total_seconds() < CLAIM_SETTLE:
            live.add(r["item_id"])
    return live, holders


def _job_limits(conn: Any, job_ids: Collection[str]) -> dict[str, int]:
    """job -> its per-server limit, for the jobs of ``job_ids`` that are still running."""
    out: dict[str, int] = {}
    ids = list(job_ids)
    if not ids:
        return out
    rows = conn.execute(select(moves_table.c.move_id, moves_table.c.params).where(
        moves_table.c.move_id.in_(ids), moves_table.c.status == RUNNING)).all()
    for move_id, params in rows:
        out[move_id] = max(1, int(json.loads(params or "{}").get("per_server") or DEFAULT_PER_SERVER))
    return out


def claim(journal: Journal, job_ids: Collection[str] | None = None) -> Item | None:
    """Claim the next item of a running job (of ``job_ids`` when given), or None (see the module docstring).

    The claim only says who is about to take the item's lease; the lease take (an epoch
    compare-and-swap) decides between two claimers that both saw its earlier claimer dead.
    """
    _ensure(journal)
    with journal.store.transaction(journal.server) as conn:
        sql_dialect(conn).advisory_xact_lock(conn, CLAIM_LOCK_KEY)
        now = func.current_timestamp().label("now")
        claimed = conn.execute(select(job_items.c.item_id, job_items.c.source, job_items.c.target, job_items.c.claimed_at, now)
                               .where(job_items.c.status.in_([PENDING, STOPPING]), job_items.c.worker.isnot(None))).mappings().all()
        live, _ = _live_claims(conn, claimed)
        busy: dict[str, int] = {}
        for r in claimed:
            if r["item_id"] in live:
                for server in {r["source"], r["target"]}:
                    busy[server] = busy.get(server, 0) + 1
        query = select(job_items, now).where(job_items.c.status == PENDING)
        if job_ids is not None:
            query = query.where(job_items.c.job_id.in_(list(job_ids)))
        # SKIP LOCKED where the server has row locks; SQLAlchemy renders none for SQLite, whose
        # one writer at a time already keeps two claimers apart.
        query = query.order_by(job_items.c.pass_no, job_items.c.seq).limit(500).with_for_update(skip_locked=True)
        candidates = conn.execute(query).mappings().all()
        limits = _job_limits(conn, {r["job_id"] for r in candidates})
        for r in candidates:
            limit = limits.get(r["job_id"])
            if limit is None or r["item_id"] in live:
                continue
            if any(busy.get(s, 0) >= limit for s in {r["source"], r["target"]}):
                continue
            conn.execute(update(job_items).where(job_items.c.item_id == r["item_id"]).values(
                worker=me(), claimed_at=func.current_timestamp(), attempts=job_items.c.attempts + 1,
                updated_at=func.current_timestamp()))
            item = Item.from_row(r)
            item.attempts += 1
            item.worker = me()
            return item
    return None


def item_servers(cluster: Cluster, journal: Journal, item: Item) -> list[str]:
    """Where an item's driver writes: CENTRAL (journal, relocations), its source and its target."""
    return list(dict.fromkeys([*cluster.router.central_servers(), journal.server, item.source, item.target]))


def item_state(journal: Journal, item_id: str) -> str | None:
    with journal.store.transaction(journal.server) as conn:
        return conn.execute(select(job_items.c.status).where(job_items.c.item_id == item_id)).scalar_one_or_none()


def finish_item(fenced: Cluster, journal_server: str, item_id: str, result: ItemResult) -> None:
    """Mark the item done with what it moved, through the item's fenced cluster (a stale driver is refused)."""
    with fenced.transaction(journal_server) as conn:
        conn.execute(update(job_items).where(job_items.c.item_id == item_id).values(
            status=DONE, result=result.to_json(), updated_at=func.current_timestamp()))


def progress_item(fenced: Cluster, journal_server: str, item_id: str, result: ItemResult) -> None:
    """What the item has moved so far (after each batch), for the job's counts; fenced like every write of the item."""
    with fenced.transaction(journal_server) as conn:
        conn.execute(update(job_items).where(job_items.c.item_id == item_id, job_items.c.status == PENDING)
                     .values(result=result.to_json(), updated_at=func.current_timestamp()))


def results_of(journal: Journal, job_id: str, pass_no: int, known: dict[str, str] | None = None) -> dict[str, ItemResult]:
    """What each item of the pass has moved so far (done or not).

    ``known``: the result texts read last time (updated here); only items whose text changed
    are parsed and returned. The job's holder polls this while items run, and parsing every
    item's GDIDs on every poll took the CPU the workers needed (a third of a 2-core reshard).
    """
    with journal.store.transaction(journal.server) as conn:
        rows = conn.execute(select(job_items.c.item_id, job_items.c.result).where(
            job_items.c.job_id == job_id, job_items.c.pass_no == pass_no, job_items.c.result.isnot(None))).all()
    if known is None:
        return {item_id: ItemResult.from_json(result) for item_id, result in rows}
    changed = {item_id: result for item_id, result in rows if known.get(item_id) != result}
    known.update(changed)
    return {item_id: ItemResult.from_json(result) for item_id, result in changed.items()}


def count_open(journal: Journal, job_id: str, pass_no: int) -> int:
    """How many items of the pass are not done or dropped (no rows parsed: the holder polls it)."""
    _ensure(journal)
    with journal.store.transaction(journal.server) as conn:
        return int(conn.execute(select(func.count()).select_from(job_items).where(
            job_items.c.job_id == job_id, job_items.c.pass_no == pass_no,
            job_items.c.status.in_([PENDING, STOPPING]))).scalar_one())


def release_item(fenced: Cluster, journal_server: str, item_id: str) -> None:
    """A worker stops before the item is done: claimable again (pending), or dropped when its job stopped."""
    with fenced.transaction(journal_server) as conn:
        conn.execute(update(job_items).where(job_items.c.item_id == item_id, job_items.c.status == PENDING)
                     .values(worker=None, claimed_at=None, updated_at=func.current_timestamp()))
        conn.execute(update(job_items).where(job_items.c.item_id == item_id, job_items.c.status == STOPPING)
                     .values(status=DROPPED, updated_at=func.current_timestamp()))


def give_back(fenced: Cluster, journal_server: str, item_id: str) -> None:
    """A worker stopped inside the item (an error, Ctrl-C mid-batch): its claim lapses at once, the claimer kept.

    A batch of it may be left journaled as running: the item counts as claimed by a gone worker
    (its lease released, no claim time), so the next claimer (``attempts`` > 1) or the job's next
    holder (:func:`settle`) resolves what it left first, without the :data:`CLAIM_SETTLE` wait;
    and :func:`stop_items` asks it to stop instead of dropping it, so nothing it left is forgotten.
    """
    with fenced.transaction(journal_server) as conn:
        conn.execute(update(job_items).where(job_items.c.item_id == item_id, job_items.c.status.in_([PENDING, STOPPING]))
                     .values(claimed_at=None, updated_at=func.current_timestamp()))


def open_items(journal: Journal, job_id: str, pass_no: int | None = None) -> list[Item]:
    """The job's items not done or dropped (of one pass when given)."""
    _ensure(journal)
    query = select(job_items).where(job_items.c.job_id == job_id, job_items.c.status.in_([PENDING, STOPPING]))
    if pass_no is not None:
        query = query.where(job_items.c.pass_no == pass_no)
    with journal.store.transaction(journal.server) as conn:
        return [Item.from_row(r) for r in conn.execute(query.order_by(job_items.c.seq)).mappings()]


def done_since(journal: Journal, job_id: str, pass_no: int, seen: set[str]) -> list[tuple[str, ItemResult]]:
    """Items of the pass done that are not in ``seen`` (added to it), with what they moved."""
    with journal.store.transaction(journal.server) as conn:
        rows = conn.execute(select(job_items.c.item_id, job_items.c.result).where(
            job_items.c.job_id == job_id, job_items.c.pass_no == pass_no, job_items.c.status == DONE)).all()
    out = [(item_id, ItemResult.from_json(result)) for item_id, result in rows if item_id not in seen]
    seen.update(item_id for item_id, _ in out)
    return out


def last_pass(journal: Journal, job_id: str) -> int:
    _ensure(journal)
    with journal.store.transaction(journal.server) as conn:
        return int(conn.execute(select(func.coalesce(func.max(job_items.c.pass_no), 0)).where(job_items.c.job_id == job_id)).scalar_one())


def stop_items(journal: Journal, job_id: str) -> None:
    """The job stops: its unclaimed items are dropped, the claimed ones asked to stop after their batch in hand
    (or, given back mid-batch, left for :func:`settle` to resolve what their worker left)."""
    _ensure(journal)
    with journal.store.transaction(journal.server) as conn:
        sql_dialect(conn).advisory_xact_lock(conn, CLAIM_LOCK_KEY)
        mine = (job_items.c.job_id == job_id) & (job_items.c.status == PENDING)
        conn.execute(update(job_items).where(mine, job_items.c.worker.is_(None)).values(status=DROPPED, updated_at=func.current_timestamp()))
        conn.execute(update(job_items).where(mine).values(status=STOPPING, updated_at=func.current_timestamp()))


def settle(journal: Journal, job_id: str, resolve: Callable[[Item], None], *, poll: float = 0.25,
           on_wait: Callable[[list[Item]], None] | None = None) -> None:
    """Before a job's holder plans: no item of the job is left open (see the module docstring).

    Items a live worker drives are asked to stop and waited for; the others are taken with their
    lease and ``resolve`` finishes or rolls back what their last claimer left, then dropped.
    """
    stop_items(journal, job_id)
    while True:
        left = open_items(journal, job_id)
        if not left:
            return
        with journal.store.transaction(journal.server) as conn:
            rows = conn.execute(select(job_items.c.item_id, job_items.c.claimed_at, func.current_timestamp().label("now"))
                                .where(job_items.c.item_id.in_([i.item_id for i in left]))).mappings().all()
            live, _ = _live_claims(conn, rows)
        waiting = [i for i in left if i.item_id in live]
        for item in left:
            if item.item_id not in live:
                resolve(item)
        if waiting:
            if on_wait is not None:
                on_wait(waiting)
            time.sleep(poll)


def drop(fenced: Cluster, journal_server: str, item_id: str) -> None:
    with fenced.transaction(journal_server) as conn:
        conn.execute(update(job_items).where(job_items.c.item_id == item_id, job_items.c.status.in_([PENDING, STOPPING]))
                     .values(status=DROPPED, updated_at=func.current_timestamp()))


def forget(journal: Journal, job_id: str) -> None:
    """The job ended: its items go (the journal and the history keep what it moved)."""
    _ensure(journal)
    with journal.store.transaction(journal.server) as conn:
        conn.execute(delete(job_items).where(job_items.c.job_id == job_id))


@dataclass
class WorkerRow:
    """An item in flight, for ``mdb moves status``: which job, which servers, who drives it."""

    item_id: str
    job_id: str
    source: str
    target: str
    briefcases: int
    worker: str | None
    holder: Holder | None

    def to_json(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "job_id": self.job_id, "source": self.source, "target": self.target,
                "briefcases": self.briefcases, "worker": self.worker,
                "holder": None if self.holder is None else self.holder.to_json()}


def workers(journal: Journal) -> list[WorkerRow]:
    """Claimed items of running jobs with their lease holders (pid, host, last beat)."""
    _ensure(journal)
    with journal.store.transaction(journal.server) as conn:
        rows = conn.execute(select(job_items).where(job_items.c.status.in_([PENDING, STOPPING]), job_items.c.worker.isnot(None))
                            .order_by(job_items.c.job_id, job_items.c.seq)).mappings().all()
        holders = holders_in(conn, [r["item_id"] for r in rows])
    return [WorkerRow(r["item_id"], r["job_id"], r["source"], r["target"], len(json.loads(r["gdids"])), r["worker"],
                      holders.get(r["item_id"])) for r in rows]
