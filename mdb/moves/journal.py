"""The move journal: one CENTRAL row per move and per reshard, updated before every step.

A step is written *before* it is taken, so after a crash the row says how far the move may
have got; the authoritative answer to "did it pass its commit point?" is still the fence on
the source shard (see :mod:`mdb.moves.resume`), the journal only says where to look. All rows
live on the CENTRAL shard of the key ``mdb:moves`` (FNV-1a like any CENTRAL key), so status
and resume read one table.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from sqlalchemy import BigInteger, Column, DateTime, Integer, String, Table, Text, func, insert, select, update
from sqlalchemy.engine import RowMapping

from mdb.cluster import Cluster
from mdb import telemetry
from mdb.moves import history
from mdb.gdid import GDID
from mdb.sqltypes import GDIDType
from mdb.system_tables import central_metadata

__all__ = [
    "CANCEL_STEP",
    "FINISHED",
    "JOB_KINDS",
    "JOURNAL_KEY",
    "MOVES_JOB_KINDS",
    "Journal",
    "JournalEntry",
    "move_leases",
    "moves_table",
    "new_move_id",
]

JOURNAL_KEY: Final = "mdb:moves"

RUNNING: Final = "running"
DONE: Final = "done"
ABORTED: Final = "aborted"
ROLLED_BACK: Final = "rolled back"
CANCELLED: Final = "cancelled"
FINISHED: Final = frozenset({DONE, ABORTED, ROLLED_BACK, CANCELLED})

MOVES_JOB_KINDS: Final = ("rebalance", "drain")
"""Jobs of a fixed list of planned moves (:mod:`mdb.moves.movejob`): their moves are journaled under them."""
JOB_KINDS: Final = ("reshard", *MOVES_JOB_KINDS)
"""Entries that are jobs in CENTRAL (:mod:`mdb.moves.jobs`): driven under a lease by their command, a worker or resume."""
CANCEL_STEP: Final = "cancel"
"""The step a job records before a cancel undoes or stops anything (an interrupted cancel is finished by resume)."""

moves_table = Table(
    "mdb_moves",
    central_metadata,
    Column("move_id", String(64), primary_key=True),
    Column("kind", String(16), nullable=False),  # 'move' | 'reshard'
    Column("reshard_id", String(64), nullable=True, index=True),
    Column("area", String(63), nullable=False),
    Column("gdid", GDIDType, nullable=True),
    Column("source", String(63), nullable=True),
    Column("target", String(63), nullable=True),
    Column("step", String(40), nullable=False),
    Column("status", String(16), nullable=False, index=True),
    Column("detail", Text, nullable=True),
    Column("params", Text, nullable=False, default="{}"),
    Column("tables", Text, nullable=False, default="{}"),  # {table: [rows planned, rows done]}
    Column("briefcases_total", Integer, nullable=False, default=0),
    Column("briefcases_done", Integer, nullable=False, default=0),
    Column("rows_total", Integer, nullable=False, default=0),
    Column("rows_done", Integer, nullable=False, default=0),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
)


move_leases = Table(
    "mdb_move_leases",
    central_metadata,
    # Who drives a journal entry now (mdb.moves.lease); the row exists only while it is held.
    Column("move_id", String(64), primary_key=True),
    Column("pid", Integer, nullable=True),
    Column("host", String(255), nullable=True),
    Column("token", String(32), nullable=True),  # new on every take: the compare-and-swap of a takeover
    Column("since", DateTime(timezone=True), nullable=True),
    Column("beat_at", DateTime(timezone=True), nullable=True),
    Column("stop_by", String(300), nullable=True),  # set by `mdb moves cancel`: the driver stops at its next check
    # +1 on every take, never reset (the row stays, holder NULL, when released): the fencing token (mdb.moves.fencing)
    Column("epoch", BigInteger, nullable=False, server_default="1"),
)


_tables_ready: set[tuple[str, str]] = set()
"""(server, URL) of CENTRALs where the history tables are known to exist (created on demand once per process)."""


def new_move_id(kind: str = "move") -> str:
    return f"{kind}-{uuid.uuid4().hex[:16]}"


@dataclass
class JournalEntry:
    move_id: str
    kind: str
    area: str
    step: str
    status: str
    gdid: GDID | None = None
    source: str | None = None
    target: str | None = None
    reshard_id: str | None = None
    detail: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, list[int]] = field(default_factory=dict)
    briefcases_total: int = 0
    briefcases_done: int = 0
    rows_total: int = 0
    rows_done: int = 0
    started_at: datetime | None = None
    updated_at: datetime | None = None

    @classmethod
    def from_row(cls, row: RowMapping) -> JournalEntry:
        return cls(
            move_id=row["move_id"], kind=row["kind"], area=row["area"], step=row["step"], status=row["status"],
            gdid=row["gdid"], source=row["source"], target=row["target"], reshard_id=row["reshard_id"],
            detail=row["detail"], params=json.loads(row["params"] or "{}"), tables=json.loads(row["tables"] or "{}"),
            briefcases_total=row["briefcases_total"], briefcases_done=row["briefcases_done"],
            rows_total=row["rows_total"], rows_done=row["rows_done"],
            started_at=row["started_at"], updated_at=row["updated_at"],
        )

    @property
    def briefcases(self) -> list[GDID]:
        """The briefcases this row moves: a batch's (listed in ``params['gdids']``), a move's one, a reshard's none."""
        if "gdids" in self.params:
            return [GDID.parse(g) for g in self.params["gdids"]]
        return [] if self.gdid is None else [self.gdid]

    def to_json(self) -> dict[str, Any]:
        return {
            "move_id": self.move_id, "kind": self.kind, "area": self.area,
            "gdid": None if self.gdid is None else str(self.gdid), "source": self.source, "target": self.target,
            "reshard_id": self.reshard_id, "step": self.step, "status": self.status, "detail": self.detail,
            "params": self.params, "tables": self.tables,
            "briefcases_total": self.briefcases_total, "briefcases_done": self.briefcases_done,
            "rows_total": self.rows_total, "rows_done": self.rows_done,
            "started_at": None if self.started_at is None else self.started_at.isoformat(),
            "updated_at": None if self.updated_at is None else self.updated_at.isoformat(),
        }


class Journal:
    """Reads and writes ``mdb_moves``; every write is its own committed transaction."""

    def __init__(self, store: Cluster) -> None:
        self._store = store
        self.server: str = store.router.locate_central(JOURNAL_KEY).server

    @property
    def store(self) -> Cluster:
        return self._store

    def _ready(self, conn: Any) -> None:
        """The phase and history tables exist on this CENTRAL (an older one may lack them)."""
        key = (self.server, str(self._store.map.servers[self.server].primary))
        if key not in _tables_ready:
            history.ensure_tables(conn)
            _tables_ready.add(key)

    def start(self, entry: JournalEntry) -> None:
        with self._store.transaction(self.server) as conn:
            self._ready(conn)
            conn.execute(
                insert(moves_table).values(
                    move_id=entry.move_id, kind=entry.kind, area=entry.area, gdid=entry.gdid, source=entry.source,
                    target=entry.target, reshard_id=entry.reshard_id, step=entry.step, status=entry.status,
                    detail=entry.detail, params=json.dumps(entry.params), tables=json.dumps(entry.tables),
                    briefcases_total=entry.briefcases_total, briefcases_done=entry.briefcases_done,
                    rows_total=entry.rows_total, rows_done=entry.rows_done,
                )
            )
            history.add_phase(conn, entry.move_id, entry.step)
        telemetry.move_step(entry.move_id, entry.step)

    def step(self, move_id: str, step: str, **values: Any) -> None:
        """Record that ``step`` is about to be taken (plus any counters/fields given), and when (the job's phase timings)."""
        self._write(move_id, dict(step=step, **values), phase=step)
        telemetry.move_step(move_id, step)

    def update(self, move_id: str, **values: Any) -> None:
        self._write(move_id, values)

    def pause(self, move_id: str, seconds: float) -> None:
        """A committed move or batch held its briefcases' writes for ``seconds``: kept for its job's pause p99 (history)."""
        with self._store.transaction(self.server) as conn:
            self._ready(conn)
            history.add_phase(conn, move_id, history.PAUSE, seconds)

    def _write(self, move_id: str, values: dict[str, Any], *, phase: str | None = None, finished: bool = False) -> None:
        """One committed transaction: the row's new values, plus the phase row of a step, or the history row of a finish."""
        for name in ("params", "tables"):
            if name in values and not isinstance(values[name], str):
                values[name] = json.dumps(values[name])
        with self._store.transaction(self.server) as conn:
            changed = conn.execute(
                update(moves_table).where(moves_table.c.move_id == move_id)
                .values(updated_at=func.current_timestamp(), **values)
            ).rowcount
            if not changed:
                raise LookupError(f"move {move_id!r} is not in the journal on server {self.server!r}")
            if phase is not None:
                self._ready(conn)
                history.add_phase(conn, move_id, phase)
            if finished:
                self._ready(conn)
                row = conn.execute(select(moves_table).where(moves_table.c.move_id == move_id)).mappings().one()
                children: list[str] = []
                if row["kind"] == "reshard":
                    children = list(conn.execute(select(moves_table.c.move_id).where(
                        moves_table.c.reshard_id == move_id, moves_table.c.move_id != move_id)).scalars())
                history.record_finish(conn, dict(row), children)

    def finish(self, move_id: str, status: str, detail: str | None = None, **values: Any) -> None:
        """The job ended with ``status``; a reshard or a move of its own also gets its row in the history (same transaction)."""
        self._write(move_id, dict(status=status, step=status, detail=detail, **values), finished=True)
        telemetry.move_finished(move_id, status)

    def get(self, move_id: str) -> JournalEntry | None:
        with self._store.transaction(self.server) as conn:
            row = conn.execute(select(moves_table).where(moves_table.c.move_id == move_id)).mappings().first()
        return None if row is None else JournalEntry.from_row(row)

    def entries(
        self, *, unfinished: bool = False, finished: bool = False, reshard_id: str | None = None, limit: int | None = None
    ) -> list[JournalEntry]:
        """Newest first: by start, or for ``finished`` ones by when they finished (a reshard ends after its moves)."""
        query = select(moves_table).order_by(moves_table.c.started_at.desc(), moves_table.c.move_id)
        if unfinished:
            query = query.where(moves_table.c.status == RUNNING)
        if finished:
            query = query.where(moves_table.c.status != RUNNING).order_by(None).order_by(
                moves_table.c.updated_at.desc(), moves_table.c.started_at.desc(), moves_table.c.move_id)
        if reshard_id is not None:
            query = query.where(moves_table.c.reshard_id == reshard_id)
        if limit is not None:
            query = query.limit(limit)
        with self._store.transaction(self.server) as conn:
            return [JournalEntry.from_row(r) for r in conn.execute(query).mappings()]

    def moves_of(self, reshard_id: str) -> list[JournalEntry]:
        """Every move journaled for a reshard (any status), oldest first."""
        # every move kind (SQL 'move', 'mongo-move'): a reshard moves its partition's briefcases with the shards' kind
        query = select(moves_table).where(moves_table.c.reshard_id == reshard_id, moves_table.c.kind != "reshard")
        with self._store.transaction(self.server) as conn:
            return [JournalEntry.from_row(r) for r in conn.execute(query.order_by(moves_table.c.started_at, moves_table.c.move_id)).mappings()]

    def reshard_counts(self, reshard_id: str) -> Mapping[str, int]:
        """status -> number of moves of a reshard (exact, from the journal)."""
        with self._store.transaction(self.server) as conn:
            rows = conn.execute(
                select(moves_table.c.status, func.count()).where(moves_table.c.reshard_id == reshard_id)
                .group_by(moves_table.c.status)
            ).all()
        return {status: count for status, count in rows}
