"""Who drives a journal entry: one owner per running move or reshard, with a heartbeat.

Two ``mdb moves resume`` started at once both read the same unfinished entries and both acted
on them (the second failed midway), and after a Ctrl-C nothing said whether
a reshard's process was still alive (item 10). So a driver (a single ``mdb move``, a reshard,
a resume, a cancel) first takes the entry's *lease*: a row in CENTRAL table
``mdb_move_leases`` beside the journal, naming its pid and host, when it took it and its last
heartbeat. A thread beats every :func:`lease_beat` seconds while the lease is held; the same
beat reads whether another process asked the driver to stop (``mdb moves cancel``).

A lease is free when nobody holds it, when its pid is gone from this host (a SIGKILLed or
crashed driver: taken over at once), or when it is held from another host and its beat is
older than :func:`lease_stale` seconds. A live process on this host keeps its lease however
old its beat (it may be stopped in a debugger or by SIGSTOP; kill it to take over). A reused
pid on this host keeps a dead driver's lease until that process ends. Taking a lease is a
compare-and-swap on the lease's epoch, so of two processes taking over one dead driver's lease
exactly one wins. The moves of a reshard are driven under the reshard's lease.

A lease is not a fence (DESIGN.md invariant 7): a driver paused past its lease on another host
wakes up believing it still holds it. So every take increments the lease's **epoch** (the row
stays when released, holder emptied, so epochs never repeat), the new holder claims that epoch
on every server the entry may touch, and the driver writes only through
:meth:`Lease.fenced`, whose transactions check the epoch on the server (:mod:`mdb.moves.fencing`).

``MDB_HOST_NAME`` overrides the host name a driver records (containers that share a host name,
or tests of two "hosts" on one machine); ``MDB_LEASE_STALE_SECONDS`` and
``MDB_LEASE_BEAT_SECONDS`` override :func:`lease_stale` and :func:`lease_beat`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, insert, inspect, select, text, update

from mdb.cluster import Cluster
from mdb.errors import DuplicateRowError, LeaseLostError, MdbError, MoveLeaseHeldError, ReshardStoppedError
from mdb.moves import fencing
from mdb.moves.journal import JOB_KINDS, Journal, JournalEntry, move_leases

__all__ = [
    "Holder", "Lease", "check_stop", "lease_beat", "lease_stale", "this_host", "describe", "describe_liveness", "ensure_table", "fenced_servers", "hold", "holder_of",
    "holders_in",
    "lease_owner_id", "liveness", "me", "refuse_if_busy", "request_stop",
]

log = logging.getLogger("mdb.moves.lease")


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise MdbError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise MdbError(f"{name}={raw!r} must be more than 0 seconds")
    return value


def lease_beat() -> float:
    """Seconds between two heartbeats of a held lease (``MDB_LEASE_BEAT_SECONDS``, default 5).

    Read from the environment when used, like every setting of mdb: never frozen at import."""
    return _seconds("MDB_LEASE_BEAT_SECONDS", 5.0)


def lease_stale() -> float:
    """A lease held from another host whose beat is older than this many seconds is taken over
    (``MDB_LEASE_STALE_SECONDS``, default 30)."""
    return _seconds("MDB_LEASE_STALE_SECONDS", 30.0)


def this_host() -> str:
    """The host name a lease records (``MDB_HOST_NAME``, else the machine's)."""
    return os.environ.get("MDB_HOST_NAME") or socket.gethostname()

_registry: dict[str, Lease] = {}
_registry_lock = threading.Lock()
_ensured: set[str] = set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class Holder:
    """The driver holding a lease, as its row says."""

    move_id: str
    pid: int
    host: str
    token: str
    since: datetime
    beat_at: datetime
    beat_age: float
    """Seconds since the last beat, by the journal server's clock."""

    @property
    def mine(self) -> bool:
        return self.host == this_host() and self.pid == os.getpid()

    @property
    def alive(self) -> bool:
        if self.host == this_host():
            return _pid_alive(self.pid)
        return self.beat_age < lease_stale()

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} since {_utc(self.since):%Y-%m-%d %H:%M:%S} UTC (last beat {self.beat_age:.0f}s ago)"

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": self.host, "since": _utc(self.since).isoformat(),
                "last_beat_seconds_ago": round(self.beat_age, 1), "alive": self.alive}


def _ensure_table(journal: Journal) -> None:
    """Create ``mdb_move_leases`` on a CENTRAL created before it existed (``schema apply`` creates it too)."""
    if journal.server in _ensured:
        return
    with journal.store.transaction(journal.server) as conn:
        move_leases.create(conn, checkfirst=True)
        if "epoch" not in {c["name"] for c in inspect(conn).get_columns(move_leases.name)}:  # created by an older mdb
            conn.execute(text(f"ALTER TABLE {move_leases.name} ADD COLUMN epoch BIGINT NOT NULL DEFAULT 1"))
    _ensured.add(journal.server)


def _lease_row(journal: Journal, move_id: str) -> tuple[Holder | None, int | None]:
    """(who holds ``move_id``'s lease, its epoch); (None, None) when it was never taken."""
    _ensure_table(journal)
    with journal.store.transaction(journal.server) as conn:
        row = conn.execute(
            select(move_leases, func.current_timestamp().label("now")).where(move_leases.c.move_id == move_id)
        ).mappings().first()
    if row is None:
        return None, None
    if row["pid"] is None:
        return None, int(row["epoch"])
    age = (_utc(row["now"]) - _utc(row["beat_at"])).total_seconds()
    return Holder(move_id, row["pid"], row["host"], row["token"], row["since"], row["beat_at"], max(age, 0.0)), int(row["epoch"])


def holders_in(conn: Any, move_ids: Iterable[str]) -> dict[str, Holder]:
    """In the caller's CENTRAL transaction: who holds each of ``move_ids``' leases (those nobody holds are absent)."""
    ids = list(dict.fromkeys(move_ids))
    out: dict[str, Holder] = {}
    for i in range(0, len(ids), 500):
        rows = conn.execute(select(move_leases, func.current_timestamp().label("now")).where(
            move_leases.c.move_id.in_(ids[i:i + 500]), move_leases.c.pid.isnot(None))).mappings()
        for row in rows:
            age = (_utc(row["now"]) - _utc(row["beat_at"])).total_seconds()
            out[row["move_id"]] = Holder(row["move_id"], row["pid"], row["host"], row["token"], row["since"], row["beat_at"], max(age, 0.0))
    return out


def ensure_table(journal: Journal) -> None:
    """``mdb_move_leases`` exists on the journal's CENTRAL (created by an older mdb without it: made here)."""
    _ensure_table(journal)


def holder_of(journal: Journal, move_id: str) -> Holder | None:
    """Who holds ``move_id``'s lease now (None: nobody)."""
    return _lease_row(journal, move_id)[0]


def fenced_servers(cluster: Cluster, journal: Journal, entry: JournalEntry) -> list[str]:
    """Every server a driver of ``entry`` may have written to: its claims go there at every take.

    CENTRAL's servers (journal, relocations), the entry's source and target, and for a reshard
    its old and new shards (another job: its ``servers``) and the servers of every move journaled under it.
    """
    servers = [*cluster.router.central_servers(), journal.server]
    if entry.kind in JOB_KINDS:
        servers += [*entry.params.get("old_shards", []), *entry.params.get("new_shards", []), *entry.params.get("servers", [])]
        for move in journal.moves_of(entry.move_id):
            servers += [s for s in (move.source, move.target) if s is not None]
    servers += [s for s in (entry.source, entry.target) if s is not None]
    known = cluster.map.servers
    return [s for s in dict.fromkeys(servers) if s in known]


def lease_owner_id(entry: JournalEntry) -> str:
    """The lease that covers ``entry``: a reshard's moves are driven under the reshard's, except those of a
    work item of a reshard job (``params['item']``, :mod:`mdb.moves.jobs`), driven under the item's by whichever worker claimed it."""
    item = entry.params.get("item")
    if isinstance(item, str) and entry.kind != "reshard":
        return item
    return entry.reshard_id if entry.kind != "reshard" and entry.reshard_id is not None else entry.move_id


class Lease:
    """A held lease: beats in a thread until released; says whether a stop was asked for."""

    def __init__(self, journal: Journal, move_id: str, token: str, epoch: int, beat: float) -> None:
        self.journal = journal
        self.beat = beat
        """Seconds between two heartbeats, read when the lease was taken."""
        self.move_id = move_id
        self.token = token
        self.epoch = epoch
        """This take's fencing token: one more than the lease's previous take."""
        self.depth = 1
        self.stop_by: str | None = None
        self.lost = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"mdb-lease-{move_id}", daemon=True)

    def _beat(self) -> None:
        while not self._done.wait(self.beat) and not self.lost:
            try:
                self._beat_once()
            except Exception as exc:  # a beat that fails is retried; a stale beat is the other side's signal
                log.warning("heartbeat of %s failed: %s", self.move_id, exc)

    def _beat_once(self) -> None:
        """Renew the beat if the row is still ours (else: lost), and read whether a stop was asked for."""
        with self.journal.store.transaction(self.journal.server) as conn:
            mine = (move_leases.c.move_id == self.move_id) & (move_leases.c.token == self.token)
            if not conn.execute(update(move_leases).where(mine).values(beat_at=func.current_timestamp())).rowcount:
                if self._done.is_set():  # released meanwhile by this process (a beat racing the release): not lost
                    return
                self.lost = True
                log.error("the lease of %s was taken over by another process; stopping at the next check", self.move_id)
                return
            self.stop_by = conn.execute(select(move_leases.c.stop_by).where(mine)).scalar_one_or_none()

    def check(self) -> None:
        """Raise :class:`ReshardStoppedError` when another process asked this driver to stop, or took over."""
        if self.lost:
            raise LeaseLostError(f"{self.move_id}: its lease was taken over by another process; stopped")
        if self.stop_by is not None:
            raise ReshardStoppedError(f"{self.move_id}: stopped at the request of {self.stop_by} (`mdb moves cancel`)")

    def fenced(self, cluster: Cluster, servers: Iterable[str]) -> fencing.FencedCluster:
        """``cluster`` with every transaction conditional on this take's epoch, claimed first on ``servers``.

        ``servers``: every server a driver of this entry may have written to (the old holder's
        writes there are finished or refused once this returns); others are claimed on first use.
        """
        fencing.claim(cluster, servers, self.move_id, self.epoch)
        return fencing.FencedCluster(cluster, self.move_id, self.epoch)


def _take(journal: Journal, move_id: str) -> tuple[str, int]:
    """Take the lease (returns its new token and epoch) or raise :class:`MoveLeaseHeldError` naming its live holder.

    A new entry's lease (every single move) is one INSERT at epoch 1; a lease someone holds or
    held is read and, if nobody holds it or its holder is gone, taken by compare-and-swap on its
    epoch, which the take increments.
    """
    for _ in range(3):
        mine = {"pid": os.getpid(), "host": this_host(), "token": uuid.uuid4().hex, "since": func.current_timestamp(),
                "beat_at": func.current_timestamp(), "stop_by": None}
        try:  # a driver paused inside its heartbeat's transaction holds the row: ended after a grace, not waited for
            with journal.store.transaction(journal.server) as conn, fencing.ending_blockers(journal.store, conn, journal.server, move_id):
                conn.execute(insert(move_leases).values(move_id=move_id, epoch=1, **mine))
            return str(mine["token"]), 1
        except DuplicateRowError:  # Store.transaction translates the unique violation
            pass  # held, or held before
        holder, epoch = _lease_row(journal, move_id)
        if epoch is None:
            continue  # deleted meanwhile (an older mdb releases by deleting): insert again
        if holder is not None and holder.alive and not holder.mine:
            raise MoveLeaseHeldError(move_id, holder.describe())
        with journal.store.transaction(journal.server) as conn, fencing.ending_blockers(journal.store, conn, journal.server, move_id):
            taken = conn.execute(update(move_leases).where(
                move_leases.c.move_id == move_id, move_leases.c.epoch == epoch,
            ).values(epoch=epoch + 1, **mine)).rowcount
        if taken:
            if holder is not None and not holder.mine:
                log.warning("took over %s from its dead driver, %s (lease epoch %d)", move_id, holder.describe(), epoch + 1)
            return str(mine["token"]), epoch + 1
    raise MoveLeaseHeldError(move_id, "another process that keeps taking it (tried 3 times)")


def _release(lease: Lease) -> None:
    """Empty the holder; the row and its epoch stay, so the next take's epoch is higher than every one before."""
    lease._done.set()
    try:
        with lease.journal.store.transaction(lease.journal.server) as conn:
            conn.execute(update(move_leases).where(move_leases.c.move_id == lease.move_id, move_leases.c.token == lease.token)
                         .values(pid=None, host=None, token=None, beat_at=None, stop_by=None))
    except Exception as exc:  # the pid is gone soon: the next driver takes the lease over then
        log.warning("could not release the lease of %s: %s", lease.move_id, exc)


@contextmanager
def hold(journal: Journal, move_id: str) -> Iterator[Lease]:
    """Hold ``move_id``'s lease for the block (re-entrant within this process)."""
    with _registry_lock:
        lease = _registry.get(move_id)
        if lease is not None:
            lease.depth += 1
    if lease is None:
        beat = lease_beat()  # a bad MDB_LEASE_BEAT_SECONDS is refused here, before the lease is taken
        lease_stale()  # (and a bad MDB_LEASE_STALE_SECONDS), not later in the heartbeat thread
        _ensure_table(journal)
        lease = Lease(journal, move_id, *_take(journal, move_id), beat=beat)
        with _registry_lock:
            _registry[move_id] = lease
        lease._thread.start()
    try:
        yield lease
    finally:
        with _registry_lock:
            lease.depth -= 1
            last = lease.depth == 0
            if last:
                del _registry[move_id]
        if last:
            _release(lease)


def check_stop(move_id: str) -> None:
    """Raise if this process holds ``move_id``'s lease and was asked to stop (checked between moves)."""
    lease = _registry.get(move_id)
    if lease is not None:
        lease.check()


def request_stop(journal: Journal, move_id: str, by: str) -> bool:
    """Ask the driver holding ``move_id`` to stop at its next check; False when nobody holds it."""
    _ensure_table(journal)
    with journal.store.transaction(journal.server) as conn:
        return bool(conn.execute(update(move_leases).where(move_leases.c.move_id == move_id, move_leases.c.pid.isnot(None))
                                 .values(stop_by=by)).rowcount)


def me() -> str:
    return f"pid {os.getpid()} on host {this_host()}"


def liveness(journal: Journal, entry: JournalEntry) -> tuple[str, Holder | None]:
    """("running", holder) when a live process drives ``entry`` (or its reshard), else ("interrupted", last holder or None)."""
    holder = holder_of(journal, lease_owner_id(entry))
    if holder is not None and (holder.alive or holder.mine):
        return "running", holder
    return "interrupted", holder


def describe_liveness(journal: Journal, entry: JournalEntry) -> str:
    """What ``mdb moves status`` and refusals say about an unfinished entry's process."""
    if entry.gdid is None and entry.kind not in JOB_KINDS:  # neither a briefcase move (any kind) nor a job
        return f"{entry.kind} at step {entry.step!r} (its driver is not recorded)"
    return describe(*liveness(journal, entry))


def refuse_if_busy(journal: Journal, area: str) -> None:
    """Refuse a reshard or a job of ``area`` while the area has an unfinished move, reshard or job (one at a time)."""
    busy = [e for e in journal.entries(unfinished=True) if e.area == area]
    if busy:
        raise MdbError(
            f"area {area!r} has unfinished moves, reshards or jobs ({'; '.join(f'{e.move_id}: {describe_liveness(journal, e)}' for e in busy)}): "
            "let a running one finish, or run `mdb moves resume MAP` for an interrupted one"
        )


def describe(state: str, holder: Holder | None) -> str:
    if state == "running" and holder is not None:
        return f"running (pid {holder.pid}, host {holder.host}, last beat {holder.beat_age:.0f}s ago)"
    return "interrupted: run `mdb moves resume MAP`"
