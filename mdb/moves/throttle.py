"""Throttling a reshard: a rate ceiling and a pause while replicas lag.

A reshard competes with production for the same disks, CPUs and WAL stream. Like Vitess's
throttler and MongoDB's balancer settings, mdb lets an operator cap it (``--rate``) and makes it
wait while a replica of a server it touches falls behind (``--max-lag``): a read replica that
lags serves stale reads, and a promoted replica that lags loses writes. The reshard calls
:meth:`Throttle.wait` before every cutover (one briefcase or a batch); nothing is held while it
waits, so a throttled reshard is slower, never less safe.

The rate is paced, not bucketed: each cutover reserves the time its briefcases and rows cost at
the configured rate, and starts when that time has passed (it pays first): over any span from
the first cutover on, at most rate x span briefcases have started. Paying afterwards let the
first cutovers through at once, and with batches growing 8, 16, 32, 64 a reshard under
``--rate 100`` moved 133 in its first second. A reshard that ran slower than the
rate (or waited for a replica) gains no credit for a burst afterwards.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from mdb.backends import backend_of
from mdb.cluster import Cluster
from mdb.errors import MdbError, ServerUnavailableError

__all__ = [
    "DEFAULT_REPLICA_TIMEOUT",
    "RATE_SYNTAX",
    "Throttle",
    "ThrottleSettings",
    "replica_lag",
    "replicas_of",
]

DEFAULT_REPLICA_TIMEOUT: Final = 300.0
"""Seconds a throttle waits for an unreachable replica before the reshard gives up."""

RATE_SYNTAX: Final = (
    "a comma-separated list of a number of briefcases per second (500, 500/s, 500briefcases) and/or "
    "of rows per second (20000rows, 20000rows/s), e.g. 500,20000rows"
)

_RATE_TERM = re.compile(r"^(?P<n>[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>[a-z]*)\s*(?:/\s*s)?$")
_BRIEFCASE_UNITS = frozenset({"", "bc", "briefcase", "briefcases"})
_ROW_UNITS = frozenset({"row", "rows"})
_LAG = re.compile(r"^(?P<n>[0-9]+(?:\.[0-9]*)?)\s*(?P<unit>s|ms)?$")


def _positive(value: float | None, what: str) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise MdbError(f"{what} must be a positive number, not {value!r}")


@dataclass(frozen=True)
class ThrottleSettings:
    """How fast a reshard may go and how much replica lag it tolerates; None: no limit.

    Journaled in the reshard's params so that `mdb moves resume` continues with the limits the
    operator chose, not at full speed.
    """

    briefcases_per_second: float | None = None
    rows_per_second: float | None = None
    max_lag: float | None = None
    """Seconds of replica lag that pause the reshard."""
    replica_timeout: float = DEFAULT_REPLICA_TIMEOUT
    """Seconds an unreachable replica is waited for before the reshard stops (with --max-lag)."""

    def __post_init__(self) -> None:
        _positive(self.briefcases_per_second, "briefcases per second")
        _positive(self.rows_per_second, "rows per second")
        _positive(self.max_lag, "--max-lag")
        _positive(self.replica_timeout, "the replica timeout")

    @property
    def limited(self) -> bool:
        """Whether anything is throttled at all (an unlimited reshard skips the throttle)."""
        return self.briefcases_per_second is not None or self.rows_per_second is not None or self.max_lag is not None

    def to_params(self) -> dict[str, Any]:
        """``{"throttle": {...}}``, merged into the reshard's journaled params."""
        return {"throttle": asdict(self)}

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> ThrottleSettings:
        """The settings a reshard journaled; a journal of an older mdb has none: unlimited."""
        recorded = params.get("throttle") or {}
        if not isinstance(recorded, Mapping):
            raise MdbError(f"the journaled throttle settings are not a mapping: {recorded!r}")

        def number(name: str) -> float | None:
            value = recorded.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise MdbError(f"the journaled throttle setting {name} is not a number: {value!r}")
            return float(value)

        timeout = number("replica_timeout")
        return cls(number("briefcases_per_second"), number("rows_per_second"), number("max_lag"),
                   DEFAULT_REPLICA_TIMEOUT if timeout is None else timeout)

    @classmethod
    def parse(cls, rate: str | None, max_lag: str | None, replica_timeout: float | None = None) -> ThrottleSettings:
        """The CLI's ``--rate`` and ``--max-lag`` text (see :data:`RATE_SYNTAX`); a precise MdbError on bad input."""
        briefcases: float | None = None
        rows: float | None = None
        if rate is not None:
            terms = [t.strip().lower() for t in rate.split(",")]
            if not any(terms):
                raise MdbError(f"--rate {rate!r} is empty: give {RATE_SYNTAX}")
            for term in terms:
                match = _RATE_TERM.match(term)
                if match is None:
                    raise MdbError(f"--rate {rate!r}: cannot read {term!r}; give {RATE_SYNTAX}")
                value, unit = float(match["n"]), match["unit"]
                if unit in _BRIEFCASE_UNITS:
                    if briefcases is not None:
                        raise MdbError(f"--rate {rate!r} gives briefcases per second twice")
                    briefcases = value
                elif unit in _ROW_UNITS:
                    if rows is not None:
                        raise MdbError(f"--rate {rate!r} gives rows per second twice")
                    rows = value
                else:
                    raise MdbError(f"--rate {rate!r}: unknown unit {unit!r} in {term!r}; give {RATE_SYNTAX}")
                if not (math.isfinite(value) and value > 0):
                    raise MdbError(f"--rate {rate!r}: {term!r} must be more than 0 per second")
        lag: float | None = None
        if max_lag is not None:
            match = _LAG.match(max_lag.strip().lower())
            if match is None:
                raise MdbError(f"--max-lag {max_lag!r}: give seconds of replica lag, e.g. 5, 2.5s or 500ms")
            lag = float(match["n"]) / (1000.0 if match["unit"] == "ms" else 1.0)
            if not lag > 0:
                raise MdbError(f"--max-lag {max_lag!r} must be more than 0 seconds")
        if replica_timeout is not None and not (math.isfinite(replica_timeout) and replica_timeout > 0):
            raise MdbError(f"--replica-timeout {replica_timeout!r} must be more than 0 seconds")
        return cls(briefcases, rows, lag, DEFAULT_REPLICA_TIMEOUT if replica_timeout is None else replica_timeout)

    def describe(self) -> str:
        """One line for the CLI and logs, e.g. "at most 500 briefcases/s, pause while replica lag > 5 s"."""
        parts = []
        if self.briefcases_per_second is not None:
            parts.append(f"at most {self.briefcases_per_second:g} briefcases/s")
        if self.rows_per_second is not None:
            parts.append(f"at most {self.rows_per_second:g} rows/s")
        if self.max_lag is not None:
            parts.append(f"pause while replica lag > {self.max_lag:g} s (an unreachable replica stops it after {self.replica_timeout:g} s)")
        return ", ".join(parts) if parts else "not throttled"


# The lag is measured on the replica the map names, not on the primary through
# pg_stat_replication.replay_lag: the map's replica URL may be a cascaded standby, a load
# balancer or a host whose walsender row cannot be matched to the map entry
# (application_name is whatever its primary_conninfo says), and replay_lag turns NULL once
# the standby is idle, which reads the same as "no such replica". Asking the replica answers
# for exactly the server the application reads from, and an unreachable replica shows
# itself as an error, not as a missing row.
#
# now() - pg_last_xact_replay_timestamp() alone is wrong when the primary is idle: the last
# replayed commit gets older by the second although nothing is left to replay. So: everything
# received is replayed -> lag 0; otherwise the age of the last replayed commit (the time the
# replica is behind the primary's commit it has not shown yet). Not in recovery at all (the
# URL names a primary) -> 0, nothing replays there. Limits: a replica whose WAL receiver itself
# is behind (network) counts as caught up until the WAL arrives; right after a long idle
# period the first unreplayed commit can look as old as the idle time for one check.
_LAG_SQL = text(
    "SELECT pg_is_in_recovery(), "
    "coalesce(pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn(), false), "
    "extract(epoch FROM now() - pg_last_xact_replay_timestamp())"
)


def replica_lag(cluster: Cluster, server: str) -> float:
    """Seconds the replica of ``server`` (from the map) is behind its primary; inf if it never replayed a commit."""
    with cluster.transaction(server, readonly=True) as conn:
        conn.execute(text("SET LOCAL statement_timeout = 5000"))  # a hung replica is "unreachable", not a hung reshard
        row = conn.execute(_LAG_SQL).one()
    in_recovery, caught_up, age = row
    if not in_recovery or caught_up:
        return 0.0
    return math.inf if age is None else max(float(age), 0.0)


def replicas_of(cluster: Cluster, servers: Sequence[str]) -> list[str]:
    """The servers among ``servers`` whose replica lag the throttle watches: SQL servers with a
    ``replica:`` URL in the map that are not SQLite files (a file has no streaming replica)."""
    out: list[str] = []
    for server in dict.fromkeys(servers):
        if (backend_of(cluster.map, server).replicas_on_engines and cluster.engines.has_replica(server)
                and cluster.engines.sql_dialect(server).streams_replicas):
            out.append(server)
    return out


class Throttle:
    """Blocks a reshard's cutovers as long as its rate or its replicas' lag require.

    ``wait`` is called by every worker of a parallel reshard; the rate is one budget for all of
    them (the pacing schedule is reserved under a lock, the sleeping is done outside it), and
    one worker at a time measures the replicas while the others queue behind it.

    ``on_wait(reason, seconds)`` is called before each sleep (``seconds``: how long this sleep
    is, at most ``poll_interval``); whatever it raises ends the wait, which is how a caller
    stops a throttled reshard that was cancelled (e.g. it checks ``mdb moves cancel`` there).
    ``lag_of(server)`` replaces the measurement (tests); by default :func:`replica_lag`.
    """

    def __init__(
        self,
        cluster: Cluster,
        settings: ThrottleSettings,
        servers: Sequence[str],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        on_wait: Callable[[str, float], None] | None = None,
        poll_interval: float = 1.0,
        lag_check_interval: float = 1.0,
        lag_of: Callable[[str], float] | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._sleep = sleep
        self._on_wait = on_wait
        self._poll = poll_interval
        self._lag_check_interval = lag_check_interval
        self.replicas: list[str] = replicas_of(cluster, servers) if settings.max_lag is not None else []
        self._lag_of: Callable[[str], float] = lag_of if lag_of is not None else (lambda server: replica_lag(cluster, server))
        self._rate_lock = threading.Lock()
        self._next_start: float | None = None
        self._lag_lock = threading.Lock()
        self._lag_ok_at: float | None = None
        self._unreachable_since: dict[str, float] = {}
        self._stats_lock = threading.Lock()
        self.waited: dict[str, float] = {"rate": 0.0, "lag": 0.0, "unreachable": 0.0}
        """Seconds slept per cause, for the final report and tests."""

    def wait(self, briefcases: int, rows: int) -> None:
        """Called by the reshard BEFORE it cuts over ``briefcases`` briefcases carrying ``rows`` rows;
        blocks as long as the rate or the replica lag of the watched servers requires. Thread-safe."""
        if briefcases < 0 or rows < 0:
            raise ValueError(f"a cutover of {briefcases} briefcases and {rows} rows")
        self._pace(briefcases, rows)
        self._wait_for_replicas()

    def cost(self, briefcases: int, rows: int) -> float:
        """Seconds of the rate budget a cutover of this size uses: the stricter of the two limits."""
        s = self.settings
        return max(
            briefcases / s.briefcases_per_second if s.briefcases_per_second else 0.0,
            rows / s.rows_per_second if s.rows_per_second else 0.0,
        )

    def _pace(self, briefcases: int, rows: int) -> None:
        cost = self.cost(briefcases, rows)
        if cost <= 0.0:
            return
        with self._rate_lock:
            now = self._clock()
            start = now if self._next_start is None else max(now, self._next_start)
            until = self._next_start = start + cost  # this cutover's own cost is waited for before it starts
        while True:
            left = until - self._clock()
            if left <= 0:
                return
            step = min(left, self._poll)
            self._waiting(f"rate limit: {self.settings.describe()}", step, "rate")

    def _waiting(self, reason: str, seconds: float, cause: str) -> None:
        if self._on_wait is not None:
            self._on_wait(reason, seconds)
        self._sleep(seconds)
        with self._stats_lock:
            self.waited[cause] += seconds

    def _wait_for_replicas(self) -> None:
        limit = self.settings.max_lag
        if limit is None or not self.replicas:
            return
        with self._lag_lock:
            while True:
                now = self._clock()
                if self._lag_ok_at is not None and now - self._lag_ok_at < self._lag_check_interval:
                    return
                behind: list[str] = []
                down: list[str] = []
                for server in self.replicas:
                    try:
                        lag = self._lag_of(server)
                    except (MdbError, SQLAlchemyError, OSError) as exc:
                        since = self._unreachable_since.setdefault(server, now)
                        if now - since >= self.settings.replica_timeout:
                            raise ServerUnavailableError(
                                server,
                                f"its replica could not be asked for its lag for {now - since:.0f} s (the replica timeout is "
                                f"{self.settings.replica_timeout:g} s); the reshard stops between two cutovers, resume it "
                                f"once the replica answers: {exc}",
                            ) from exc
                        down.append(f"{server} ({now - since:.0f} s: {_one_line(exc)})")
                        continue
                    self._unreachable_since.pop(server, None)
                    if lag > limit:
                        behind.append(f"{server} {lag:.1f} s" if math.isfinite(lag) else f"{server} (has replayed no commit)")
                if not behind and not down:
                    self._lag_ok_at = self._clock()
                    return
                self._lag_ok_at = None
                if down:
                    lagging = f"; replica lag above {limit:g} s: {', '.join(behind)}" if behind else ""
                    self._waiting(f"replica unreachable, waiting: {', '.join(down)}{lagging}", self._poll, "unreachable")
                else:
                    self._waiting(f"replica lag above {limit:g} s: {', '.join(behind)}", self._poll, "lag")


def _one_line(exc: BaseException) -> str:
    line = str(exc).strip().splitlines()
    return line[0] if line else type(exc).__name__
