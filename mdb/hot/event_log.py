"""Event log + incremental snapshots (event sourcing with a CQRS read side).

Writers only append immutable events to a stream (a briefcase's ledger, a CENTRAL stream). A
snapshot job folds the events no snapshot has folded yet into the next snapshot; a read loads
the latest snapshot and replays only the events after it.

**Why a fold marker and not "events with id > the snapshot's last id".** With concurrent
writers, ids (and sequence numbers, and timestamps) are handed out in one order and committed
in another: an event with a small id can commit after a snapshot has already covered larger
ids, and a high-water mark would skip it forever. Instead each event carries ``snapshot_seq``,
NULL when appended. The snapshot job, in one transaction:

1. locks the stream's head row (snapshot number 0, created on first use), so two jobs on one
   stream run one after the other;
2. claims the events that are still unmarked: ``UPDATE .. SET snapshot_seq = n+1 WHERE
   stream = s AND snapshot_seq IS NULL RETURNING ..``; an event whose transaction has not
   committed is not visible to that statement and simply stays unmarked;
3. writes snapshot n+1 = snapshot n folded with exactly the claimed events.

So every event is either marked with the one snapshot that folded it or unmarked: none is
skipped, none is folded twice. A read takes the latest snapshot (number n) and the events with
no marker or a marker above n (a snapshot committed between the two statements has marked
events with n+1; they are still replayed, and its state is not used). The marker is the only
write to an event after its append; payloads are never changed.

Folds run in Python (:class:`Fold`). The log's canonical order is fold order: by snapshot, and
within a snapshot (and in the tail) by event id. A fold whose result does not depend on order
(sums, counts, min/max) gives the same state however appends and snapshots interleave.

**A payload is checked against the fold when it is appended**, because an event the fold
cannot take would otherwise stop every later read and snapshot of its stream: the payload must
be a JSON object and the fold must accept it on its initial state. Events already stored that
the fold refuses (data from before this check, or a fold changed since) raise
:class:`~mdb.errors.FoldError` naming the stream, briefcase and event; a snapshot pass
(:func:`run_snapshots`) reports such a stream and goes on with the others.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import func, or_, select, update
from sqlalchemy.engine import Connection

from mdb.errors import FoldError, RoutingError, SchemaError, StatsError
from mdb.fanout import fan_out_servers
from mdb.gdid import GDID
from mdb.session import BriefcaseSession
from mdb.dialects import sql_dialect
from mdb.hot.scope import Scope, central, insert_once, place_of
from mdb.hot.tables import LABEL_LENGTH, NAME_LENGTH, EventLogTables, check_name, derived_gdid
from mdb.system_tables import STATE_INCOMING, briefcase_state
from mdb.registry import Kind, Registry, default_registry

if TYPE_CHECKING:
    from mdb.briefcase import BriefcaseType
    from mdb.cluster import Cluster

__all__ = [
    "EventLog",
    "Fold",
    "SnapshotResult",
    "StreamState",
    "SumFold",
    "registered_logs",
    "run_snapshots",
]

State = dict[str, Any]


class Fold(Protocol):
    """How events become state. States and payloads are JSON objects."""

    def initial(self) -> State: ...

    def apply(self, state: State, kind: str, payload: Mapping[str, Any]) -> State: ...


@dataclass(frozen=True)
class SumFold:
    """Sums integer payload ``fields`` and counts events: a balance, a vote tally."""

    fields: tuple[str, ...]

    def initial(self) -> State:
        return {"events": 0, **{f: 0 for f in self.fields}}

    def apply(self, state: State, kind: str, payload: Mapping[str, Any]) -> State:
        out = dict(state)
        out["events"] += 1
        for f in self.fields:
            value = payload.get(f, 0)
            if not isinstance(value, int) or isinstance(value, bool):
                raise StatsError(
                    f"SumFold: payload field {f!r} must be an integer (int), got {type(value).__name__} {value!r} (event kind {kind!r})"
                )
            out[f] += value
        return out


@dataclass(frozen=True)
class StreamState:
    """A read: the state, the snapshot it started from, and how many tail events were replayed."""

    state: State
    snapshot_seq: int
    tail_events: int


@dataclass(frozen=True)
class SnapshotResult:
    stream: str
    key: GDID | None
    seq: int
    """The stream's latest snapshot number after this run (-1: it failed before its snapshots were read)."""
    folded: int
    """Events folded by this run (0: nothing new, no snapshot written, or the stream failed)."""
    server: str = ""
    error: str | None = None
    """Why the stream could not be folded (its pass rolled back, nothing claimed); None when it was."""


EVENT_LOGS: Kind[EventLog] = Kind("event log")


def registered_logs(registry: Registry | None = None) -> list[EventLog]:
    """Every event log declared so far in ``registry`` (the default one: what ``mdb snapshot`` works on)."""
    return (registry or default_registry).items(EVENT_LOGS)


class EventLog:
    """Operations on one event-log table pair with its fold; declaring one registers it by table name."""

    def __init__(self, tables: EventLogTables, fold: Fold, *, registry: Registry | None = None) -> None:
        self.tables = tables
        self.fold = fold
        (registry or default_registry).add(EVENT_LOGS, tables.events.name, self)

    @property
    def name(self) -> str:
        return self.tables.events.name

    def __repr__(self) -> str:
        return f"EventLog({self.name!r}, fold={self.fold!r})"

    # -- writers ------------------------------------------------------------------------------------

    def append(self, target: Scope | BriefcaseSession, stream: str, event_id: GDID, kind: str, payload: Mapping[str, Any]) -> bool:
        """Append one event; False when an event with this id is already in the log (a redelivery)."""
        if not isinstance(event_id, GDID):
            raise StatsError(f"event id must be a GDID (from store.gdids(...)), got {event_id!r}")
        check_name("event kind", kind, LABEL_LENGTH)
        place = self._place(target, stream, write=True)
        document = self._checked_payload(stream, event_id, kind, payload)
        ev = self.tables.events
        stmt = (
            sql_dialect(place.conn).insert(ev)
            .values(**place.key_values(), event_id=event_id, stream=stream, kind=kind, payload=document)
            .on_conflict_do_nothing(index_elements=[*place.key_values(), "event_id"])
            .returning(ev.c.event_id)
        )
        return place.conn.execute(stmt).first() is not None

    def _checked_payload(self, stream: str, event_id: GDID, kind: str, payload: Mapping[str, Any]) -> State:
        """The payload as the log stores and reads it back, if the fold accepts it.

        Checked at append because a payload the fold refuses would otherwise surface only at
        the next read or snapshot pass, and from then on every read of the stream would fail.
        The payload goes through JSON (what the column hands back: a tuple becomes a list; NaN
        is not JSON) and is folded onto the fold's initial state; whatever the fold raises
        refuses the append.
        """
        where = f"event log {self.name!r}, stream {stream!r}, event {event_id}"
        if not isinstance(payload, Mapping):
            raise StatsError(f"{where}: payload must be a mapping (a JSON object), got {type(payload).__name__}")
        try:
            document: State = json.loads(json.dumps(dict(payload), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise StatsError(f"{where}: payload {payload!r} is not JSON: {exc}") from exc
        try:
            self.fold.apply(self.fold.initial(), kind, document)
        except Exception as exc:  # the fold is application code: anything it raises refuses the event
            raise StatsError(f"{where}: payload refused by the fold {self.fold!r}: {exc}") from exc
        return document

    def _apply(
        self, state: State, event_id: GDID, kind: str, payload: Mapping[str, Any], *, where: str, stream: str, server: str, seq: int
    ) -> State:
        """``state`` with one stored event folded in, or a FoldError naming the stream and the event."""
        try:
            return self.fold.apply(state, kind, payload)
        except Exception as exc:  # the fold is application code: anything it raises means "cannot fold"
            raise FoldError(
                f"{where}: stream {stream!r} of event log {self.name!r}: event {event_id} (kind {kind!r}) "
                f"cannot be folded by {self.fold!r}: {exc}",
                stream=stream, server=server, seq=seq,
            ) from exc

    # -- readers ------------------------------------------------------------------------------------

    def read(self, target: Scope | BriefcaseSession, stream: str) -> StreamState:
        """Latest snapshot + the events after it."""
        place = self._place(target, stream, write=False)
        seq, state = self._latest(place.conn, self._conds(place, self.tables.snapshots, stream))
        ev = self.tables.events
        tail = place.conn.execute(
            select(ev.c.event_id, ev.c.kind, ev.c.payload)
            .where(*self._conds(place, ev, stream), or_(ev.c.snapshot_seq.is_(None), ev.c.snapshot_seq > seq))
            .order_by(ev.c.event_id)
        ).all()
        for event in tail:
            state = self._apply(state, *event, where=place.where, stream=stream, server=place.server, seq=seq)
        return StreamState(state, seq, len(tail))

    def replay(self, target: Scope | BriefcaseSession, stream: str) -> State:
        """The whole log folded from the initial state (what a snapshot + tail read must equal)."""
        place = self._place(target, stream, write=False)
        ev = self.tables.events
        rows = place.conn.execute(
            select(ev.c.event_id, ev.c.kind, ev.c.payload)
            .where(*self._conds(place, ev, stream))
            .order_by(ev.c.snapshot_seq.is_(None), ev.c.snapshot_seq, ev.c.event_id)
        )
        state = self.fold.initial()
        for event in rows:
            state = self._apply(state, *event, where=place.where, stream=stream, server=place.server, seq=0)
        return state

    # -- the snapshot job ---------------------------------------------------------------------------

    def snapshot(self, target: Scope | BriefcaseSession, stream: str) -> SnapshotResult:
        """Fold the stream's unmarked events into its next snapshot (nothing new: no snapshot)."""
        place = self._place(target, stream, write=True)
        snaps, ev = self.tables.snapshots, self.tables.events
        conn = place.conn
        keys = place.key_values()
        head = {"snapshot_id": _snapshot_id(stream, 0), "stream": stream, "seq": 0,
                "state": self.fold.initial(), "events": 0, "total_events": 0}
        insert_once(place, snaps, "snapshot_id", head, ("stream", "seq"))
        snap_conds = self._conds(place, snaps, stream)
        conn.execute(select(snaps.c.seq).where(*snap_conds, snaps.c.seq == 0).with_for_update()).one()
        seq, state = self._latest(conn, snap_conds)
        total = conn.execute(select(snaps.c.total_events).where(*snap_conds, snaps.c.seq == seq)).scalar_one()
        new_seq = seq + 1
        # Claim, fold and write in one savepoint: if the fold fails, the claim is undone even
        # when the caller catches the error and commits. Markers without their snapshot would
        # be skipped by the next pass (it claims only unmarked events): lost from every state.
        with conn.begin_nested():
            claimed = conn.execute(
                update(ev)
                .where(*self._conds(place, ev, stream), ev.c.snapshot_seq.is_(None))
                .values(snapshot_seq=new_seq)
                .returning(ev.c.event_id, ev.c.kind, ev.c.payload)
            ).all()
            key = place.key
            if not claimed:
                return SnapshotResult(stream, key, seq, 0, place.server)
            for event in sorted(claimed, key=lambda r: r[0]):
                state = self._apply(state, *event, where=place.where, stream=stream, server=place.server, seq=seq)
            conn.execute(
                sql_dialect(place.conn).insert(snaps).values(
                    **keys, snapshot_id=_snapshot_id(stream, new_seq), stream=stream, seq=new_seq,
                    state=state, events=len(claimed), total_events=int(total) + len(claimed),
                )
            )
        return SnapshotResult(stream, key, new_seq, len(claimed), place.server)

    def pending_streams(self, conn: Connection, stream: str | None = None) -> list[tuple[GDID | None, str]]:
        """(briefcase key or None, stream) pairs with unmarked events in this server's table."""
        ev = self.tables.events
        key_col = [ev.c[self.tables.key_column]] if self.tables.key_column else []
        query = select(*key_col, ev.c.stream).where(ev.c.snapshot_seq.is_(None)).distinct()
        if stream is not None:
            query = query.where(ev.c.stream == stream)
        return [(row[0], row[1]) if key_col else (None, row[0]) for row in conn.execute(query)]

    # -- cross-briefcase reads ----------------------------------------------------------------------

    def read_all(self, store: Cluster, area: str, stream: str) -> dict[GDID, State]:
        """Every briefcase's state of ``stream`` in ``area`` (a leaderboard), shard by shard.

        Each shard is read in one transaction with one MVCC snapshot (REPEATABLE READ on
        PostgreSQL, a read transaction on SQLite), so snapshot and tail agree per shard; as with
        any fan-out, different shards are read at slightly different moments. Copies of
        briefcases that are being moved onto a shard (``incoming``) are skipped.
        """
        if self.tables.key_column is None:
            raise StatsError(f"event log {self.name!r} is a CENTRAL log: read its streams with read()")
        self._briefcase_type(store, area)
        key = self.tables.key_column
        snaps, ev = self.tables.snapshots, self.tables.events
        out: dict[GDID, State] = {}
        seen: set[str] = set()
        for server in fan_out_servers(store.router, area):
            url = store.engines.spec(server).primary
            if url in seen:
                continue
            seen.add(url)
            with store.transaction(server) as conn:
                sql_dialect(conn).snapshot(conn)
                incoming = set(conn.execute(
                    select(briefcase_state.c.gdid).where(briefcase_state.c.area == area, briefcase_state.c.state == STATE_INCOMING)
                ).scalars())
                latest = select(func.max(snaps.c.seq)).where(snaps.c[key] == ev.c[key], snaps.c.stream == stream).scalar_subquery()
                s2 = snaps.alias("s2")
                newest = select(func.max(s2.c.seq)).where(s2.c[key] == snaps.c[key], s2.c.stream == stream).scalar_subquery()
                states: dict[GDID, State] = {}
                for gid, state in conn.execute(select(snaps.c[key], snaps.c.state).where(snaps.c.stream == stream, snaps.c.seq == newest)):
                    states[gid] = state
                tail = conn.execute(
                    select(ev.c[key], ev.c.event_id, ev.c.kind, ev.c.payload)
                    .where(ev.c.stream == stream, or_(ev.c.snapshot_seq.is_(None), ev.c.snapshot_seq > func.coalesce(latest, -1)))
                    .order_by(ev.c[key], ev.c.event_id)
                )
                for gid, event_id, kind, payload in tail:
                    states[gid] = self._apply(
                        states[gid] if gid in states else self.fold.initial(), event_id, kind, payload,
                        where=f"briefcase {area}/{gid}", stream=stream, server=server, seq=-1,
                    )
            for gid, state in states.items():
                if gid not in incoming:
                    out[gid] = state
        return out

    # -- helpers ------------------------------------------------------------------------------------

    def _place(self, target: Scope | BriefcaseSession, stream: str, *, write: bool) -> Scope:
        check_name("stream", stream, NAME_LENGTH, write=write)
        place = place_of(target)
        place.check(self.tables.tables, self.tables.key_column, write=write)
        place.check_routed(stream)
        return place

    def _conds(self, place: Scope, table: Any, stream: str) -> list[Any]:
        return [*(table.c[k] == v for k, v in place.key_values().items()), table.c.stream == stream]

    def _latest(self, conn: Connection, snap_conds: Sequence[Any]) -> tuple[int, State]:
        snaps = self.tables.snapshots
        row = conn.execute(select(snaps.c.seq, snaps.c.state).where(*snap_conds).order_by(snaps.c.seq.desc()).limit(1)).first()
        if row is None:
            return 0, self.fold.initial()
        return int(row[0]), dict(row[1])

    def _briefcase_type(self, store: Cluster, area: str) -> type[BriefcaseType]:
        for btype in store.types_of(area):
            if self.tables.events in btype.tables:
                if self.tables.snapshots not in btype.tables:
                    raise SchemaError(f"briefcase type {btype.__name__} lists {self.name!r} but not its snapshots table")
                return btype
        raise RoutingError(f"no briefcase type of area {area!r} registered with this Store holds event log {self.name!r}")


def _snapshot_id(stream: str, seq: int) -> GDID:
    return derived_gdid("snapshot", stream, seq)


def run_snapshots(store: Cluster, log: EventLog, where: str, *, stream: str | None = None) -> list[SnapshotResult]:
    """One snapshot pass of ``log`` over ``where`` (an area name, or ``central``).

    Finds streams with unmarked events on every shard, then snapshots each in its own
    transaction: a briefcase stream through a briefcase session (routed, ownership-checked,
    waits for a move), a CENTRAL stream on the shard its key routes to. Safe to run on a
    schedule, next to writers and next to another pass.

    A stream that cannot be snapshotted (an event the fold cannot take, a derived-id clash on
    its snapshot rows, a name stored before names were checked) is isolated: its transaction
    rolls back (nothing claimed), its result carries the ``error``, and the pass goes on with
    the other streams, so one bad stream does not stop the snapshots of a whole area.
    """
    results: list[SnapshotResult] = []
    if where == "central":
        if log.tables.key_column is not None:
            raise StatsError(f"event log {log.name!r} lives in briefcases (key {log.tables.key_column!r}), not on CENTRAL")
        pending: dict[str, str] = {}
        for server in store.router.central_servers():
            with store.transaction(server) as conn:
                pending.update(dict.fromkeys((s for _k, s in log.pending_streams(conn, stream)), server))
        for name, server in pending.items():

            def central_pass(name: str = name) -> SnapshotResult:
                with central(store, name) as place:
                    return log.snapshot(place, name)

            results.append(_isolated(name, None, server, central_pass))
        return results
    if log.tables.key_column is None:
        raise StatsError(f"event log {log.name!r} is a CENTRAL log: run it with 'central', not area {where!r}")
    btype = log._briefcase_type(store, where)
    todo: dict[tuple[GDID | None, str], str] = {}
    for server in fan_out_servers(store.router, where):
        with store.transaction(server) as conn:
            todo.update(dict.fromkeys(log.pending_streams(conn, stream), server))
    for (key, name), server in todo.items():
        assert key is not None

        def briefcase_pass(key: GDID = key, name: str = name) -> SnapshotResult:
            with store.briefcase(btype, key) as session:
                return log.snapshot(session, name)

        results.append(_isolated(name, key, server, briefcase_pass))
    return results


def _isolated(stream: str, key: GDID | None, server: str, run: Callable[[], SnapshotResult]) -> SnapshotResult:
    """``run()``'s result, or a failed result when the stream cannot be snapshotted.

    ``run`` opens and closes its own transaction, so when it raises, that transaction has
    rolled back before the failure is recorded. Other errors (a server down, a move that does
    not finish) are not the stream's fault and end the pass.
    """
    try:
        return run()
    except FoldError as exc:
        return SnapshotResult(stream, key, exc.seq, 0, exc.server, error=str(exc))
    except StatsError as exc:
        return SnapshotResult(stream, key, -1, 0, server, error=str(exc))
