"""Metrics and traces through OpenTelemetry: every instrument mdb records, defined once.

mdb depends on the OpenTelemetry *API* only. Instruments come from the API's global providers
under the name ``mdb``; until the application installs an SDK those are proxies whose
``add``/``record`` is one attribute test, so telemetry costs next to nothing by default. An
SDK installed later (``metrics.set_meter_provider``) is picked up by the same proxies: nothing
here has to be re-created (tests/postgres/test_telemetry.py checks that).

Labels are low-cardinality on purpose: area, server, outcome, reason, step, kind, index and
sequence scope, all names from the map or the code. Never a GDID, a key or a move id: a label
value per briefcase would make every series unbounded. Spans may carry a move id (a trace is
per event anyway), never a GDID or a key.

Every hook elsewhere in mdb is one line calling a function of this module; the functions do
as little as possible per call (cached attribute dicts, no string formatting), because the
briefcase session path is hot (tools/benchmarks/briefcase.py measures it). The list of
metrics, units and labels is in docs/observability.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager, contextmanager, nullcontext
from functools import wraps
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from opentelemetry import metrics, trace

from mdb.errors import BriefcaseMovingError, StaleRouteError

if TYPE_CHECKING:
    from mdb.router import Placement


class _RoutedSession(Protocol):
    """What the session counter needs of a briefcase session: where it was routed."""

    @property
    def placement(self) -> Placement: ...


_S = TypeVar("_S", bound=_RoutedSession)

__all__ = [
    "central_lookup",
    "fanout_partial",
    "fanout_shard",
    "fanout_shard_read",
    "gdid_block",
    "move_done",
    "move_finished",
    "move_step",
    "move_verification_failed",
    "observed_async_session",
    "observed_documents",
    "observed_session",
    "ownership_refused",
    "stale_retry",
]

NAME = "mdb"
_meter = metrics.get_meter(NAME)
_tracer = trace.get_tracer(NAME)

SESSIONS = _meter.create_counter(
    "mdb.briefcase.sessions", unit="{session}", description="Briefcase sessions ended, by area, server and outcome (ok | error)."
)
STALE_RETRIES = _meter.create_counter(
    "mdb.route.stale_retries", unit="{retry}", description="Sessions re-routed after a refresh because the shard refused the route."
)
OWNERSHIP_REFUSALS = _meter.create_counter(
    "mdb.ownership.refusals", unit="{refusal}", description="Ownership checks a shard refused, by reason (stale_route | moving | other)."
)
CENTRAL_LOOKUPS = _meter.create_counter(
    "mdb.central.cache.lookups", unit="{lookup}", description="CENTRAL unique lookups by result (hit | verified_hit | stale | miss)."
)
GDID_BLOCKS = _meter.create_counter(
    "mdb.gdid.blocks", unit="{block}", description="GDID blocks reserved in CENTRAL, by sequence scope."
)
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Histogram bounds in seconds: the SDK's default bounds (0, 5, 10, 25, ... 10000) suit
milliseconds and would put every shard read and nearly every move pause in the first bucket."""

FANOUT_SHARD_DURATION = _meter.create_histogram(
    "mdb.fanout.shard.duration", unit="s", description="Time of one shard's part of a fan-out read, by server and outcome.",
    explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
)
FANOUT_PARTIAL_FAILURES = _meter.create_counter(
    "mdb.fanout.partial_failures", unit="{shard}", description="Shards missing from a partial fan-out result (allow_partial), by server."
)
MOVES = _meter.create_counter(
    "mdb.moves", unit="{move}", description="Briefcase moves ended, by area, kind (move | reshard) and outcome (done | aborted)."
)
MOVE_ROWS = _meter.create_counter(
    "mdb.move.rows", unit="{row}", description="Rows moved by committed briefcase moves, by area and kind; rate() is rows/s."
)
MOVE_PAUSE = _meter.create_histogram(
    "mdb.move.pause.duration", unit="s", description="Write pause of committed moves (briefcase lock held), by area and kind.",
    explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
)
MOVE_VERIFICATION_FAILURES = _meter.create_counter(
    "mdb.move.verification_failures", unit="{move}", description="Moves aborted because the target copy did not verify, by area."
)

_attr_cache: dict[tuple[str, ...], Mapping[str, str]] = {}


def _attrs(names: tuple[str, ...], values: tuple[str, ...]) -> Mapping[str, str]:
    """The attribute dict for ``values``, built once per distinct label set and then shared.

    The SDK only reads attribute dicts, so one dict per label set is safe, and the hot path
    pays a dict lookup instead of building a dict per call. The cache stays small because the
    labels are low-cardinality by design.
    """
    key = names + values
    found = _attr_cache.get(key)
    if found is None:
        found = _attr_cache[key] = dict(zip(names, values, strict=True))
    return found


_SESSION = ("area", "server", "outcome")
_ROUTE = ("area", "server", "reason")
_MOVE = ("area", "kind")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, StaleRouteError):
        return "stale_route"
    if isinstance(exc, BriefcaseMovingError):
        return "moving"
    return "other"


def sdk_installed() -> bool:
    """True when an SDK records mdb's metrics or spans; cheap (two attribute reads) while none does.

    The session path asks this per session, so it reads what the API's proxies read themselves
    (the proxy counter's link to its real instrument, set by ``set_meter_provider``; the trace
    API's global provider, which its proxy tracers look up) instead of the global getters,
    which look at ``os.environ`` per call (measured: 150 ns here vs 500 ns). Both are private
    to opentelemetry-api 1.x: if one is missing (a changed API) the answer is True, so an API
    change costs speed, never a lost count.
    """
    try:  # attribute reads, not getattr(): no call per session while nothing records
        return SESSIONS._real_instrument is not None or trace._TRACER_PROVIDER is not None  # type: ignore[attr-defined]
    except AttributeError:
        return True


# -- briefcase sessions --------------------------------------------------------------------------

NO_SERVER = "-"
"""The server label of a session that failed before it was routed to one."""


class _Observation:
    """One briefcase session being observed: its span while it runs, its count when it ends.

    Shared by the sync and the async wrapper, so both feed the same instruments and spans.
    """

    __slots__ = ("_area", "_server", "_span", "_token")

    def __init__(self, area: str) -> None:
        self._area = area
        self._server = NO_SERVER
        self._span: trace.Span | None = None
        self._token: object = None

    def _start(self) -> None:
        span = _tracer.start_span("mdb.briefcase", attributes={"mdb.area": self._area})
        if span.is_recording():  # only with an SDK: the no-op path skips the context switch
            self._span = span
            self._token = trace.context_api.attach(trace.set_span_in_context(span))

    def _finish(self, outcome: str, exc: BaseException | None) -> None:
        SESSIONS.add(1, _attrs(_SESSION, (self._area, self._server, outcome)))
        span = self._span
        if span is not None:
            span.set_attribute("mdb.server", self._server)
            span.set_attribute("mdb.outcome", outcome)
            if exc is not None:
                span.record_exception(exc)
                span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            span.end()
            trace.context_api.detach(self._token)  # type: ignore[arg-type]
            self._span = None


class _ObservedSession(_Observation, AbstractContextManager[_S], Generic[_S]):
    """Wraps a briefcase session's context manager: counts it by outcome and spans it when traced."""

    __slots__ = ("_inner",)

    def __init__(self, inner: AbstractContextManager[_S], area: str) -> None:
        super().__init__(area)
        self._inner = inner

    def __enter__(self) -> _S:
        self._start()
        try:
            session = self._inner.__enter__()
        except BaseException as exc:
            self._finish("error", exc)
            raise
        self._server = session.placement.server
        return session

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        try:
            suppressed = self._inner.__exit__(exc_type, exc, tb)
        except BaseException as raised:
            self._finish("error", raised)
            raise
        self._finish("ok" if exc is None else "error", exc)
        return suppressed


class _ObservedAsyncSession(_Observation, AbstractAsyncContextManager[_S], Generic[_S]):
    """The async twin of :class:`_ObservedSession` (``AsyncStore.briefcase``): same counts, same span.

    The span's context is attached in ``__aenter__`` and detached in ``__aexit__``; both run in
    the task that uses the session, whose own contextvars copy holds it, so concurrent sessions
    on one loop never see each other's span.
    """

    __slots__ = ("_inner",)

    def __init__(self, inner: AbstractAsyncContextManager[_S], area: str) -> None:
        super().__init__(area)
        self._inner = inner

    async def __aenter__(self) -> _S:
        self._start()
        try:
            session = await self._inner.__aenter__()
        except BaseException as exc:
            self._finish("error", exc)
            raise
        self._server = session.placement.server
        return session

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        try:
            suppressed = await self._inner.__aexit__(exc_type, exc, tb)
        except BaseException as raised:
            self._finish("error", raised)
            raise
        self._finish("ok" if exc is None else "error", exc)
        return suppressed


_SessionMethod = Callable[..., AbstractContextManager[_S]]


def observed_session(method: _SessionMethod[_S]) -> _SessionMethod[_S]:
    """Decorate ``Store.briefcase``: each session counted by (area, server, outcome), spanned when traced."""

    @wraps(method)
    def briefcase(
        store: Any, btype: Any, gdid: Any, *, readonly: bool = False, exclusive: bool = False
    ) -> AbstractContextManager[_S]:
        # Store.briefcase's own signature (no *args/**kwargs to repack: this runs per session).
        if not sdk_installed():  # nothing would record it: the session as it is, no wrapper
            return method(store, btype, gdid, readonly=readonly, exclusive=exclusive)
        return _ObservedSession(method(store, btype, gdid, readonly=readonly, exclusive=exclusive), btype.area)

    return briefcase


def observed_documents(method: _SessionMethod[_S]) -> _SessionMethod[_S]:
    """Decorate ``MongoStore.documents``: a document briefcase context counts and spans as a session.

    The same series as SQL sessions (``mdb.briefcase.sessions`` by area, server, outcome; span
    ``mdb.briefcase``): an area is either SQL or documents, so the area tells them apart, and a
    dashboard of sessions per shard covers both kinds without a second metric.
    """

    @wraps(method)
    def documents(mongo: Any, dtype: Any, gdid: Any, *, readonly: bool = False) -> AbstractContextManager[_S]:
        if not sdk_installed():
            return method(mongo, dtype, gdid, readonly=readonly)
        return _ObservedSession(method(mongo, dtype, gdid, readonly=readonly), dtype.area)

    return documents


_AsyncSessionMethod = Callable[..., AbstractAsyncContextManager[_S]]


def observed_async_session(method: _AsyncSessionMethod[_S]) -> _AsyncSessionMethod[_S]:
    """Decorate ``AsyncStore.briefcase``: the series and span of :func:`observed_session`, for async sessions.

    One set of instruments for both APIs: a dashboard of sessions per shard counts a service's
    sync and async sessions alike (labels area, server, outcome).
    """

    @wraps(method)
    def briefcase(
        store: Any, btype: Any, gdid: Any, *, readonly: bool = False, exclusive: bool = False
    ) -> AbstractAsyncContextManager[_S]:
        if not sdk_installed():
            return method(store, btype, gdid, readonly=readonly, exclusive=exclusive)
        return _ObservedAsyncSession(method(store, btype, gdid, readonly=readonly, exclusive=exclusive), btype.area)

    return briefcase


def ownership_refused(area: str, server: str, exc: BaseException) -> None:
    """A session's ownership check (or BEGIN) raised a retryable error on ``server``."""
    if isinstance(exc, (StaleRouteError, BriefcaseMovingError)):
        OWNERSHIP_REFUSALS.add(1, _attrs(_ROUTE, (area, server, _reason(exc))))


def stale_retry(area: str, server: str, exc: BaseException) -> None:
    """The Store refreshed its routing and is retrying a session ``server`` refused."""
    STALE_RETRIES.add(1, _attrs(_ROUTE, (area, server, _reason(exc))))


# -- CENTRAL and GDIDs ---------------------------------------------------------------------------


def central_lookup(index: str, result: str) -> None:
    """One unique lookup of CENTRAL index ``index``: hit | verified_hit | stale | miss."""
    CENTRAL_LOOKUPS.add(1, _attrs(("index", "result"), (index, result)))


def gdid_block(scope: str) -> None:
    """A block of GDIDs was reserved from a sequence of ``scope`` (an area, or ``{area}:rows``)."""
    GDID_BLOCKS.add(1, _attrs(("scope",), (scope,)))


# -- fan-out -------------------------------------------------------------------------------------


_UNOBSERVED: AbstractContextManager[None] = nullcontext()


def fanout_shard(server: str) -> AbstractContextManager[None]:
    """Time one shard's part of a fan-out read (outcome ok | error), and span it when traced.

    Without an SDK it is a shared no-op context: the API's no-op span and histogram still
    cost ~30 Python calls per shard, most of a warm fan-out's per-shard work beside the
    statement itself (measured with tools/profile_fanout.py).
    """
    if not sdk_installed():
        return _UNOBSERVED
    return _observed_shard(server)


@contextmanager
def _observed_shard(server: str) -> Iterator[None]:
    started = time.perf_counter()
    outcome = "error"
    with _tracer.start_as_current_span("mdb.fanout.shard", attributes={"mdb.server": server}):
        try:
            yield
            outcome = "ok"
        finally:
            FANOUT_SHARD_DURATION.record(time.perf_counter() - started, _attrs(("server", "outcome"), (server, outcome)))


def fanout_shard_read(server: str, started: float, ended: float) -> None:
    """A shard's part of a fan-out that ran interleaved with the others' (one thread sends to
    every shard, then reads each: :mod:`mdb.scatter`), recorded once it is read, outcome ok.

    ``started``/``ended`` are ``time.perf_counter()`` values; the span gets those real times.
    A shard that failed there is run again through :func:`fanout_shard`, which records its outcome.
    """
    if not sdk_installed():
        return
    to_ns = time.time_ns() - time.perf_counter_ns()
    span = _tracer.start_span("mdb.fanout.shard", attributes={"mdb.server": server}, start_time=to_ns + int(started * 1e9))
    span.end(end_time=to_ns + int(ended * 1e9))
    FANOUT_SHARD_DURATION.record(ended - started, _attrs(("server", "outcome"), (server, "ok")))


def fanout_partial(failed: list[tuple[str, Any]]) -> None:
    """A fan-out ended; ``failed`` are its (server, error) pairs that ``allow_partial`` kept out."""
    for server, _ in failed:
        FANOUT_PARTIAL_FAILURES.add(1, _attrs(("server",), (server,)))


# -- moves ---------------------------------------------------------------------------------------

_move_spans: dict[str, tuple[trace.Span, trace.Span | None]] = {}
"""move id -> (the move's span, its current step's span), while the move runs in this process."""


def _kind(reshard_id: str | None) -> str:
    return "move" if reshard_id is None else "reshard"


def move_step(move_id: str, step: str) -> None:
    """The journal records ``step`` of ``move_id``: the previous step's span ends, this one's starts.

    Spans only: a step is an event of one move, not a metric series. Not recording (no SDK),
    nothing is kept.
    """
    spans = _move_spans.get(move_id)
    if spans is None:
        move = _tracer.start_span("mdb.move", attributes={"mdb.move.id": move_id})
        if not move.is_recording():
            return
        spans = (move, None)
    move, previous = spans
    if previous is not None:
        previous.end()
    child = _tracer.start_span("mdb.move.step", context=trace.set_span_in_context(move), attributes={"mdb.move.step": step})
    _move_spans[move_id] = (move, child)


def move_finished(move_id: str, status: str) -> None:
    """The journal closed ``move_id`` with ``status``: its step span and move span end."""
    spans = _move_spans.pop(move_id, None)
    if spans is None:
        return
    move, step = spans
    if step is not None:
        step.end()
    move.set_attribute("mdb.outcome", status)
    if status != "done":
        move.set_status(trace.Status(trace.StatusCode.ERROR, status))
    move.end()


def move_done(area: str, reshard_id: str | None, rows: int, pause_seconds: float) -> None:
    """A move committed: ``rows`` moved with the briefcase's writes paused ``pause_seconds``."""
    attrs = _attrs(_MOVE, (area, _kind(reshard_id)))
    MOVES.add(1, _attrs(("area", "kind", "outcome"), (area, _kind(reshard_id), "done")))
    MOVE_ROWS.add(rows, attrs)
    MOVE_PAUSE.record(pause_seconds, attrs)


def move_resumed(area: str, reshard_id: str | None, outcome: str, rows: int) -> None:
    """``mdb moves resume`` ended an interrupted move: ``done`` (finalized, ``rows`` moved) or ``aborted``."""
    attrs = _attrs(_MOVE, (area, _kind(reshard_id)))
    MOVES.add(1, _attrs(("area", "kind", "outcome"), (area, _kind(reshard_id), outcome)))
    if rows:
        MOVE_ROWS.add(rows, attrs)


def move_aborted(area: str, reshard_id: str | None) -> None:
    """A move aborted safely (the source stays authoritative)."""
    MOVES.add(1, _attrs(("area", "kind", "outcome"), (area, _kind(reshard_id), "aborted")))


def move_verification_failed(area: str) -> None:
    """A move's target copy did not match the source under the lock (the move aborts)."""
    MOVE_VERIFICATION_FAILURES.add(1, _attrs(("area",), (area,)))
