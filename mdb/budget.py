"""The connection budget of a process: how many PostgreSQL connections it may hold open.

Why: every shard database has its own pool, and a pool keeps its connections after use, so a
process that fanned out over 128 shards holds 128+ idle connections on the instances behind
them until it exits. Four such processes filled a 200-connection instance, and the next
connection was refused ("too many clients"). The budget counts the connections a process has
OPEN (idle in a pool or in use), because that is what the server counts:

* per instance (host:port; the shard databases of one instance share its ``max_connections``)
  and in total over all instances;
* a pool that needs a new connection while the budget is full first closes the least recently
  used idle connection of another pool on the same instance (or anywhere, for the total), and
  otherwise waits for one to be returned, up to the pool timeout, then raises
  :class:`~mdb.errors.CapacityError` (retryable) naming the instance;
* idle connections are closed after ``idle_timeout`` seconds by one small reaper thread, so a
  quiet process gives its connections back.

The cost sits where connections are created and closed (rare), not on the session path: a
checkout of an idle pooled connection takes one lock, as QueuePool's does.

A server that refuses a connection for capacity anyway (other processes, other clients) is
retried with backoff for up to the pool timeout: a full server usually has a slot again soon.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.engine import URL
from sqlalchemy.pool import ConnectionPoolEntry, Pool

from mdb.backoff import BackoffPolicy, Clock
from mdb.dialects import find_sql_dialect
from mdb.errors import CapacityError

__all__ = ["CAPACITY_WAIT", "BudgetPool", "ConnectionBudget", "connect_patiently", "instance_of", "is_capacity_refusal"]

log = logging.getLogger("mdb.budget")

_TOO_MANY_CONNECTIONS = "53300"
_CAPACITY_TEXT = ("too many clients already", "remaining connection slots are reserved", "too many connections for")
"""PostgreSQL's words for 53300. At connect time libpq reports only the message (psycopg's
error has no sqlstate then), so the text is what identifies it."""
_REAP_INTERVAL_MAX = 30.0
_REAP_INTERVAL_MIN = 0.05

T = TypeVar("T")


def is_capacity_refusal(error: BaseException | None) -> bool:
    """True when a driver error says the server is full (SQLSTATE 53300), not that it is down."""
    if error is None:
        return False
    if getattr(error, "sqlstate", None) == _TOO_MANY_CONNECTIONS:
        return True
    text = str(error).lower()
    return any(words in text for words in _CAPACITY_TEXT)


def instance_of(url: URL) -> str | None:
    """``host:port`` of a PostgreSQL URL (the unit that ``max_connections`` limits); None otherwise."""
    dialect = find_sql_dialect(url)
    return None if dialect is None else dialect.instance(url)


CAPACITY_WAIT = BackoffPolicy(first=0.05, cap=1.0)
"""How a connect refused for capacity is retried (up to the pool timeout)."""


def connect_patiently(
    connect: Callable[[], T], deadline: float, where: str, sleep: Callable[[float], None] = time.sleep,
    clock: Clock = time.monotonic,
) -> T:
    """``connect()``, retried with backoff while the server refuses for capacity, until ``deadline``.

    The last refusal is raised as it came (the caller's error translation turns it into a
    CapacityError); any other error is raised at once. ``sleep`` waits between tries (an async
    engine passes one that suspends on its event loop instead of blocking it); ``deadline`` is on
    ``clock``'s scale.
    """
    backoff = CAPACITY_WAIT.until(deadline, clock)
    while True:
        try:
            return connect()
        except Exception as exc:
            delay = backoff.next_delay() if is_capacity_refusal(exc) else None
            if delay is None:
                raise
            log.info("instance %s refused a connection for capacity; retrying in %.2f s", where, delay)
        sleep(delay)


class ConnectionBudget:
    """Caps on the connections one process holds open: per instance and in total.

    ``per_instance`` applies to every instance without a cap of its own (:meth:`cap`), ``None``
    means no cap. Several Stores of one process share the budget when given the same object
    (``Store(..., budget=b)``); by default each Store builds one from its map.
    """

    def __init__(self, per_instance: int | None = None, total: int | None = None) -> None:
        for name, value in (("per_instance", per_instance), ("total", total)):
            if value is not None and value < 1:
                raise ValueError(f"connection budget: {name} must be at least 1, got {value}")
        self.per_instance = per_instance
        self.total = total
        self._caps: dict[str, int] = {}
        self._open: dict[str, int] = {}
        self._open_total = 0
        self._peak: dict[str, int] = {}
        self._peak_total = 0
        self._cond = threading.Condition(threading.Lock())
        self._pools: weakref.WeakSet[BudgetPool] = weakref.WeakSet()
        self._pools_lock = threading.Lock()
        """Guards adding to and reading ``_pools``: a WeakSet iterated while another thread adds raises."""
        self.waiting = 0
        """Threads waiting in :meth:`acquire`; a pool that keeps a returned connection idle wakes them."""
        self._idled = 0
        """How many times a pool kept a connection idle while someone waited (see :meth:`acquire`)."""
        self._handed_over = 0
        """Connections pools ever handed to another thread to close (see :meth:`_shed`)."""

    def __repr__(self) -> str:
        return f"ConnectionBudget(per_instance={self.per_instance}, total={self.total}, open={self._open_total})"

    def cap(self, instance: str, limit: int | None) -> None:
        """Cap ``instance`` at ``limit`` connections (the smallest cap given wins; None: no change)."""
        if limit is None:
            return
        with self._cond:
            self._caps[instance] = min(limit, self._caps.get(instance, limit))

    def limit_total(self, limit: int | None) -> None:
        """Lower the total cap to ``limit`` (the smallest value given wins; None: no change)."""
        if limit is not None:
            with self._cond:
                self.total = limit if self.total is None else min(self.total, limit)

    def open_connections(self, instance: str | None = None) -> int:
        """Connections this budget counts as open, on ``instance`` or in total."""
        with self._cond:
            return self._open_total if instance is None else self._open.get(instance, 0)

    def peak_connections(self, instance: str | None = None) -> int:
        """The most connections this budget has counted open at once, on ``instance`` or in total.

        Whether a cap held over a run, which :meth:`open_connections` after the fact cannot
        tell. (A server may list a closed connection's backend a moment longer: it exits
        after its client has gone.)
        """
        with self._cond:
            return self._peak_total if instance is None else self._peak.get(instance, 0)

    def register(self, pool: BudgetPool) -> None:
        with self._pools_lock:
            self._pools.add(pool)

    def _instance_cap(self, instance: str) -> int | None:
        """The smaller of the instance's own cap and the budget-wide ``per_instance`` (None: no cap)."""
        caps = [c for c in (self._caps.get(instance), self.per_instance) if c is not None]
        return min(caps) if caps else None

    def _full(self, instance: str) -> str | None:
        """Which cap a new connection to ``instance`` would exceed ("instance", "total"), or None."""
        cap = self._instance_cap(instance)
        if cap is not None and self._open.get(instance, 0) >= cap:
            return "instance"
        if self.total is not None and self._open_total >= self.total:
            return "total"
        return None

    def _count_one_locked(self, instance: str) -> str | None:
        """Count one more connection to ``instance`` unless a cap is full; which one is (None: counted)."""
        full = self._full(instance)
        if full is None:
            now = self._open[instance] = self._open.get(instance, 0) + 1
            self._open_total += 1
            self._peak[instance] = max(now, self._peak.get(instance, 0))
            self._peak_total = max(self._open_total, self._peak_total)
        return full

    def acquire(self, instance: str, timeout: float) -> None:
        """Count one more open connection to ``instance``; make room or wait for it, or raise.

        Room is made by closing the least recently used idle connection of another pool (on
        the same instance when the instance cap is full, anywhere when the total is).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            self.waiting += 1  # from here on, a connection going idle bumps _idled and wakes us
        try:
            while True:
                with self._cond:
                    full = self._count_one_locked(instance)
                    if full is None:
                        return
                    idled = self._idled
                if self._shed(instance if full == "instance" else None):
                    continue
                with self._cond:
                    if self._full(instance) is None or self._idled != idled:
                        continue  # room, or a connection went idle since the scan: look again
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise self._exhausted(instance, full, timeout)
                    self._cond.wait(remaining)
        finally:
            with self._cond:
                self.waiting -= 1

    def try_acquire(self, instance: str) -> str | None:
        """Count one more open connection to ``instance`` if the caps allow, never waiting.

        Makes room as :meth:`acquire` does (closing the least recently used idle connection of
        another pool). None: counted; otherwise which cap is full ("instance" or "total"). Why:
        an async pool must not wait on this budget's thread condition, which would block its
        event loop; it retries on the loop instead (mdb.aio.engines).
        """
        while True:
            with self._cond:
                full = self._count_one_locked(instance)
                if full is None:
                    return None
            if not self._shed(instance if full == "instance" else None):
                return full

    def handed_over(self, n: int) -> None:
        """A pool took ``n`` idle connections out to be closed on another thread (its event
        loop); each stays counted until its :meth:`release`."""
        with self._cond:
            self._handed_over += n

    def wake(self) -> None:
        """A connection became idle: the waiters may now close it to make room."""
        with self._cond:
            self._idled += 1
            self._cond.notify_all()

    def release(self, instance: str) -> None:
        """One connection to ``instance`` was closed."""
        with self._cond:
            self._open[instance] = self._open.get(instance, 0) - 1
            self._open_total -= 1
            self._cond.notify_all()

    def _shed(self, instance: str | None) -> bool:
        """Close the oldest idle connection on ``instance`` (any instance: None); False if none is idle.

        Tries every pool with an idle connection, oldest first: another thread may take or close
        the one seen first, and stopping there would leave the caller asleep next to idle
        connections nobody returns again (a lost wake-up). A False here means each idle
        connection seen is now in use, and its return will wake the caller.
        """
        candidates: list[tuple[float, int, BudgetPool]] = []
        with self._pools_lock:
            pools = list(self._pools)
        for n, pool in enumerate(pools):
            if instance is not None and pool.instance != instance:
                continue
            since = pool.oldest_idle()
            if since is not None:
                candidates.append((since, n, pool))
        for _, _, pool in sorted(candidates):
            handed = self._handed_over
            if pool.close_idle(1) > 0:
                return True
            if self._handed_over != handed:
                # The pool handed its idle connection to its event loop to close (an async pool
                # asked from another thread): that release() wakes the caller; asking the next
                # pool as well would close one connection more than needed.
                return False
        return False

    def _exhausted(self, instance: str, full: str, timeout: float) -> CapacityError:
        if full == "instance":
            what = f"its cap of {self._instance_cap(instance)} connections to instance {instance}"
        else:
            what = f"its total cap of {self.total} connections"
        return CapacityError(
            f"connection budget: this process holds {what}, all in use, and none was returned within "
            f"{timeout:g} s (retry later; raise the cap or lower the concurrency: docs/operations.md)",
            instance=instance,
        )


class BudgetPool(Pool):
    """A pool that keeps up to ``pool_size`` idle connections, opens at most ``pool_size +
    max_overflow``, counts every open connection in a :class:`ConnectionBudget` and closes
    connections idle longer than ``idle_timeout``.

    Idle connections are reused newest first (LIFO), so under light load the older ones age
    out. Without :meth:`attach` it behaves as a QueuePool with those sizes.
    """

    def __init__(
        self, creator: Any, pool_size: int = 10, max_overflow: int = 20, timeout: float = 30.0, **kw: Any
    ) -> None:
        super().__init__(creator, **kw)
        self._size = pool_size
        self._max_overflow = max_overflow
        self._timeout = timeout
        self._idle: list[tuple[ConnectionPoolEntry, float]] = []  # oldest first; reuse takes the last
        self._count = 0  # connection records that exist: idle or checked out
        self._cond = threading.Condition(threading.Lock())
        self._disposed = False
        self.budget: ConnectionBudget | None = None
        self.instance = ""
        self.idle_timeout: float | None = None
        self.reuse: Callable[[ConnectionPoolEntry], None] | None = None
        """Called with an idle connection before a checkout hands it out again, outside the pool's
        lock: the engine's driver finishes what the connection's last use left in flight (mdb.engines:
        a read-only transaction's end sent unwaited). When it raises, the connection is replaced."""

    def attach(self, budget: ConnectionBudget | None, instance: str, idle_timeout: float | None) -> BudgetPool:
        """Count this pool's connections in ``budget`` as ``instance``'s; close idle ones after ``idle_timeout``."""
        self.budget, self.instance, self.idle_timeout = budget, instance, idle_timeout
        if budget is not None:
            budget.register(self)
        if idle_timeout is not None:
            _REAPER.register(self)
        return self

    # -- checkout and return ----------------------------------------------------------------

    def _do_get(self) -> ConnectionPoolEntry:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while not self._idle and self._count >= self._size + self._max_overflow:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CapacityError(
                        f"pool of instance {self.instance or '?'}: all {self._count} connections of this database "
                        f"are in use and none was returned within {self._timeout:g} s (pool_size + max_overflow "
                        f"is too small for this process's concurrency: docs/operations.md)",
                        instance=self.instance or None,
                    )
                self._wait_for_return(remaining)
            record = self._idle.pop()[0] if self._idle else None
            if record is None:
                self._count += 1
        if record is None:
            return self._open_new(deadline)
        reuse = self.reuse
        if reuse is not None and record.dbapi_connection is not None:
            try:
                reuse(record)
            except Exception as exc:
                # Its server is gone or the connection is in a state nothing should follow: SQLAlchemy's
                # checkout connects this record afresh (get_connection), as after any invalidation.
                log.warning("pool of instance %s: replacing a connection whose last transaction's end failed: %s",
                            self.instance or "?", exc)
                record.invalidate(exc)
        return record

    def _wait_for_return(self, remaining: float) -> None:
        """Wait (holding ``_cond``) up to ``remaining`` seconds for a connection to come back."""
        self._cond.wait(remaining)

    def _acquire_budget(self, timeout: float) -> None:
        """Count a new connection in the budget, waiting up to ``timeout`` for room (or raise)."""
        assert self.budget is not None
        self.budget.acquire(self.instance, timeout)

    def _open_new(self, deadline: float) -> ConnectionPoolEntry:
        """A new connection record; its slot in the pool (``_count``) is already taken."""
        try:
            if self.budget is not None:
                self._acquire_budget(max(0.0, deadline - time.monotonic()))
            try:
                return self._create_connection()
            except BaseException:
                if self.budget is not None:
                    self.budget.release(self.instance)
                raise
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        with self._cond:
            keep = not self._disposed and len(self._idle) < self._size
            if keep:
                self._idle.append((record, time.monotonic()))
            else:
                self._count -= 1
            self._cond.notify()
        if not keep:
            self._close_record(record)
        elif self.budget is not None and self.budget.waiting:  # unlocked read: the common case pays nothing
            self.budget.wake()

    def _close_record(self, record: ConnectionPoolEntry) -> None:
        try:
            record.close()
        finally:
            if self.budget is not None:
                self.budget.release(self.instance)

    # -- idle connections -------------------------------------------------------------------

    def idle_ready(self) -> bool:
        """Would a checkout now hand out an idle connection as it is, opening none?

        False when none is idle, or when the one a checkout takes (the newest: LIFO) is closed,
        due for ``pool_recycle``, or older than an invalidation of the pool: SQLAlchemy's checkout
        would then connect anew (``_ConnectionRecord.get_connection``), which a caller that must
        not block on a connect (a fan-out sent from one thread: mdb.scatter) leaves to threads.
        """
        with self._cond:
            if not self._idle:
                return False
            record: Any = self._idle[-1][0]
        started = record.starttime
        return (
            record.dbapi_connection is not None
            and (self._recycle < 0 or time.time() - started <= self._recycle)
            and self._invalidate_time <= started
            and record._soft_invalidate_time <= started
        )

    def oldest_idle(self) -> float | None:
        """When the least recently returned idle connection was returned; None when none is idle."""
        with self._cond:
            return self._idle[0][1] if self._idle else None

    def close_idle(self, limit: int | None = None, returned_before: float | None = None) -> int:
        """Close up to ``limit`` idle connections, oldest first (only those returned before
        ``returned_before``, when given); the number closed."""
        taken = self._take_idle(limit, returned_before)
        for record in taken:
            self._close_record(record)
        return len(taken)

    def _take_idle(self, limit: int | None, returned_before: float | None) -> list[ConnectionPoolEntry]:
        """Remove up to ``limit`` idle connections from the pool (see :meth:`close_idle`); the caller closes them."""
        with self._cond:
            n = 0
            while n < len(self._idle) and (limit is None or n < limit) and (
                returned_before is None or self._idle[n][1] < returned_before
            ):
                n += 1
            taken = [record for record, _ in self._idle[:n]]
            del self._idle[:n]
            self._count -= n
            self._cond.notify_all()
        return taken

    def reap(self, now: float) -> int:
        """Close the connections idle for longer than ``idle_timeout``; the number closed."""
        if self.idle_timeout is None:
            return 0
        return self.close_idle(returned_before=now - self.idle_timeout)

    # -- Pool's interface -------------------------------------------------------------------

    def recreate(self) -> BudgetPool:
        self.logger.info("Pool recreating")
        fresh = self.__class__(
            self._creator,
            pool_size=self._size,
            max_overflow=self._max_overflow,
            timeout=self._timeout,
            recycle=self._recycle,
            echo=self.echo,
            pre_ping=self._pre_ping,
            logging_name=self._orig_logging_name,
            reset_on_return=self._reset_on_return,
            _dispatch=self.dispatch,
            dialect=self._dialect,
        )
        return fresh.attach(self.budget, self.instance, self.idle_timeout)

    def dispose(self) -> None:
        """Close the idle connections; connections in use are closed when they come back."""
        with self._cond:
            self._disposed = True
        self.close_idle()
        self.logger.info("Pool disposed. %s", self.status())

    def status(self) -> str:
        return (
            f"BudgetPool instance={self.instance or '?'} size={self._size} overflow={self._max_overflow} "
            f"open={self._count} idle={len(self._idle)}"
        )

    def size(self) -> int:
        return self._size

    def timeout(self) -> float:
        return self._timeout

    def checkedin(self) -> int:
        return len(self._idle)

    def checkedout(self) -> int:
        return self._count - len(self._idle)


class _Reaper:
    """One daemon thread per process closing idle connections of every pool with an idle_timeout.

    It wakes at half the smallest idle_timeout among the live pools (so a connection lives at
    most 1.5 x its timeout once idle) and exits when no pool is left.
    """

    def __init__(self) -> None:
        self._pools: weakref.WeakSet[BudgetPool] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._interval_now: float | None = None  # what the thread waits for now (None: not computed yet)

    def register(self, pool: BudgetPool) -> None:
        with self._lock:
            self._pools.add(pool)
            if self._thread is None or not self._thread.is_alive():
                self._interval_now = None
                self._thread = threading.Thread(target=self._run, name="mdb-idle-reaper", daemon=True)
                self._thread.start()
            elif self._interval_now is None or _interval_of(pool.idle_timeout) < self._interval_now:
                # Only a shorter timeout needs the thread awake: waking it for every new pool made
                # it walk all pools per pool (quadratic) while a cold Store created 128 engines.
                self._wake.set()

    def _interval(self) -> float | None:
        timeouts = [p.idle_timeout for p in list(self._pools) if p.idle_timeout is not None and not p._disposed]
        if not timeouts:
            return None
        return _interval_of(min(timeouts))

    def _run(self) -> None:
        while True:
            with self._lock:
                interval = self._interval_now = self._interval()
                if interval is None:
                    self._thread = None
                    return
            self._wake.wait(interval)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:  # a WeakSet iterated while register() adds raises
                pools = list(self._pools)
            for pool in pools:
                try:
                    pool.reap(now)
                except Exception:  # one pool's close failing must not stop the reaping of the others
                    log.warning("closing idle connections of %s failed", pool.status(), exc_info=True)


def _interval_of(idle_timeout: float | None) -> float:
    """How often to look for idle connections when the shortest idle timeout is ``idle_timeout``."""
    if idle_timeout is None:
        return _REAP_INTERVAL_MAX
    return min(_REAP_INTERVAL_MAX, max(_REAP_INTERVAL_MIN, idle_timeout / 2))


_REAPER = _Reaper()
