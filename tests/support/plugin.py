"""The shared fixtures, a pytest plugin loaded by tests/support/plugin.py: real PostgreSQL servers (see
mdb.testing.postgres), PgBouncer, SQLite files and MongoDB.

Servers are started only when a test asks for one, then shared by the whole session; every
database a test gets is fresh and dropped afterwards. A test using a PostgreSQL fixture is
marked ``postgres``. When no server can start, such a test is skipped with the reason, except
under ``CI=true``, where it fails: CI must never go green by skipping the real-server tests.
"""

from __future__ import annotations

import os
import signal
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest
from psycopg import sql
from support.mongo import MongoEnv
from support.pgbouncer import Direct, Pooling
from sqlalchemy.engine import make_url

from mdb.testing import arm
from mdb.testing.pgbouncer import DEFAULT_POOL_SIZE, PgBouncer, pgbouncer_unavailable_reason
from mdb.testing.postgres import PostgresCluster, PostgresServer, postgres_unavailable_reason

arm()  # MDB_FAULT_POINT and MDB_MONGO_FAKE_DIR act in this process and every process a test starts


SCRATCH_IN_MEMORY_MIN_FREE = 4 << 30
"""Free bytes a tmpfs needs before the run puts its temporary files there (see below)."""


def _scratch_in_memory() -> None:
    """Put the run's temporary files (test servers' data directories, ``tmp_path``, SQLite files)
    on ``/dev/shm`` when it is a tmpfs with room, unless ``TMPDIR`` already says where they go.

    On an ext4 ``/tmp`` a test database's ``CREATE DATABASE`` after another's ``DROP DATABASE``
    cost 150-200 ms of kernel time: ext4 skips inodes freed in the last seconds when it
    allocates new ones (``recently_deleted``), and a test database is a few hundred files made
    and deleted each test. On tmpfs the same create and drop took 34 ms (docs/testing.md, "Where
    the suite's CPU goes"). A test server never needs its files to outlive the run: durability is
    off already (mdb.testing.postgres).
    """
    if "TMPDIR" in os.environ:
        return
    shm = "/dev/shm"
    try:
        with open("/proc/mounts") as mounts:
            tmpfs = any(line.split()[1:3] == [shm, "tmpfs"] for line in mounts)
        space = os.statvfs(shm)
    except OSError:
        return
    if tmpfs and space.f_bavail * space.f_frsize >= SCRATCH_IN_MEMORY_MIN_FREE and os.access(shm, os.W_OK | os.X_OK):
        os.environ["TMPDIR"] = shm  # the processes the tests start, and their children, too
        tempfile.tempdir = shm


_scratch_in_memory()


def _bytecode_cached_outside_the_tree() -> None:
    """Let the processes the tests start cache bytecode in a private folder outside the tree.

    Under ``PYTHONDONTWRITEBYTECODE`` (set on the shared machines) every ``mdb`` a test starts,
    hundreds in a run, compiled mdb's ~120 modules from source again: about a quarter of its
    start-up CPU (``mdb reshard --help`` 1.97 -> 1.49 s). With ``PYTHONPYCACHEPREFIX`` the first
    child writes them there and the others read them; the source tree stays free of bytecode,
    which is what that setting is for. Each cache file is checked against its source as usual.
    """
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    folder = Path(tempfile.gettempdir()) / f"mdb-test-pycache-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        return  # not ours alone: leave the setting as it is
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    del os.environ["PYTHONDONTWRITEBYTECODE"]


_bytecode_cached_outside_the_tree()


def _interrupts_reach_the_children() -> None:
    """Let the ``mdb`` processes the tests start take Ctrl-C, however the suite itself was started.

    A shell without job control starts a background command (``cmd &``) with SIGINT ignored,
    and an ignored signal stays ignored across fork and exec: every ``mdb`` a test starts then
    ignored the SIGINT the Ctrl-C tests send it, and they timed out (three of them, in a suite
    started that way). A handled signal is reset to its default at exec, so the children get
    SIGINT back and Python turns it into KeyboardInterrupt as in a terminal.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_interrupts_reach_the_children()

POOL_SIZE = 4
POSTGRES_FIXTURES = frozenset({"pg_cluster", "pg_databases", "pg_url", "pg_server_factory", "pg_replica_pair", "pgbouncer", "pg_route"})


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


POSTGRES_PARAMS = frozenset({"postgres", "postgresql", "pgbouncer", "postgres-to-sqlite"})
"""Parameter values by which a suite's fixture asks for PostgreSQL with ``request.getfixturevalue``
(a ``sqlite``/``postgres`` pair, the ``pgbouncer`` route): such a case needs PostgreSQL too."""


def _needs_postgres(item: pytest.Item) -> bool:
    if POSTGRES_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(isinstance(v, str) and v in POSTGRES_PARAMS for v in callspec.params.values())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _needs_postgres(item):
            item.add_marker(pytest.mark.postgres)
    # The slow tests first (otherwise in collection order): under -n N the workers start on the
    # minutes-long fault tests and fill in with the short ones, instead of finding a 4-minute test
    # at the end of the queue and waiting for it with idle cores (19.5 min for 1,291 tests at
    # -n 3 on 2 cores, cores 83% busy).
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


class _Unavailable:
    """Remembers why PostgreSQL could not start, so later tests do not retry a slow failure."""

    checked = False
    reason: str | None = None

    @classmethod
    def check(cls) -> None:
        if not cls.checked:
            cls.reason, cls.checked = postgres_unavailable_reason(), True
        if cls.reason is not None:
            cls.give_up(cls.reason)

    @classmethod
    def give_up(cls, reason: str) -> None:
        cls.reason, cls.checked = reason, True
        message = f"PostgreSQL is unavailable: {reason}"
        if _in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


def _starting(start: Callable[[], object]) -> None:
    """Run a server start; a failure is PostgreSQL being unavailable (skip, or fail in CI)."""
    _Unavailable.check()
    try:
        start()
    except (RuntimeError, OSError, TimeoutError) as exc:
        _Unavailable.give_up(f"{type(exc).__name__}: {exc}")


# -- the shared pool ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    """Up to four servers shared by the session; ``pg_databases`` starts them as needed."""
    _Unavailable.check()
    cluster = PostgresCluster(POOL_SIZE)
    yield cluster
    cluster.close()


class _Databases:
    """``pg_databases(n)``: n fresh databases on n different pool servers, dropped after the test."""

    def __init__(self, cluster: PostgresCluster) -> None:
        self._cluster = cluster
        self._made: list[tuple[PostgresServer, str]] = []

    def servers(self, n: int) -> list[PostgresServer]:
        """The pool servers ``pg_databases(n)`` puts its databases on, started."""
        if not 1 <= n <= len(self._cluster):
            raise ValueError(f"pg_databases(n) needs 1 <= n <= {len(self._cluster)}, got {n}")
        servers: list[PostgresServer] = []
        _starting(lambda: servers.extend(self._cluster.start(n)))
        return servers

    def __call__(self, n: int = 1, *, templates: Sequence[str] | None = None) -> list[str]:
        """``templates``: a database on each of those servers to copy (support.templates), else an empty one."""
        servers = self.servers(n)
        if templates is not None and len(templates) != n:
            raise ValueError(f"pg_databases({n}) got {len(templates)} templates")
        urls = []
        for index, server in enumerate(servers):
            if templates is None:
                url = server.create_database()
            else:
                url = server.url(f"t_{uuid.uuid4().hex[:16]}")
                with server.connect() as conn:
                    conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                        sql.Identifier(make_url(url).database or ""), sql.Identifier(templates[index])))
            self._made.append((server, make_url(url).database or ""))
            urls.append(url)
        return urls

    def drop_all(self) -> None:
        for server, name in self._made:
            if server.is_running:  # a test may have stopped a pool server; start() brings it back
                server.drop_database(name)


@pytest.fixture
def pg_databases(pg_cluster: PostgresCluster) -> Iterator[Callable[[int], list[str]]]:
    """Factory: ``pg_databases(n)`` -> n SQLAlchemy URLs of fresh databases, each on a different
    server (n <= 4). Call it as often as you like; everything is dropped after the test.
    ``pg_databases(n, templates=[...])`` copies those databases (support.templates)."""
    databases = _Databases(pg_cluster)
    yield databases
    databases.drop_all()


@pytest.fixture
def pg_url(pg_databases: Callable[[int], list[str]]) -> str:
    """SQLAlchemy URL of one fresh database."""
    return pg_databases(1)[0]


# -- servers a test may take down --------------------------------------------------------------


@pytest.fixture
def pg_server_factory() -> Iterator[Callable[[], PostgresServer]]:
    """Factory: ``pg_server_factory()`` -> a started server of the test's own, which it may
    ``stop()``, ``stop(immediate=True)`` or ``start()`` again; closed after the test."""
    _Unavailable.check()
    servers: list[PostgresServer] = []

    def make() -> PostgresServer:
        server = PostgresServer(name="dedicated")
        servers.append(server)
        _starting(server.start)
        return server

    yield make
    for server in servers:
        server.close()


# -- a primary with a streaming replica --------------------------------------------------------


class ReplicaPair(NamedTuple):
    primary_url: str
    replica_url: str
    wait_for_replay: Callable[[], None]


@pytest.fixture(scope="session")
def _pg_primary_and_replica() -> Iterator[tuple[PostgresServer, PostgresServer]]:
    _Unavailable.check()
    primary = PostgresServer(name="primary")
    replica: list[PostgresServer] = []
    _starting(lambda: replica.append(primary.start().start_replica()))
    yield primary, replica[0]
    primary.close()


@pytest.fixture
def pg_replica_pair(_pg_primary_and_replica: tuple[PostgresServer, PostgresServer]) -> Iterator[ReplicaPair]:
    """``(primary_url, replica_url, wait_for_replay)`` for one fresh database that exists on a
    primary and its real streaming replica. Replicas lag: call ``wait_for_replay()`` after
    writing on the primary, before reading on the replica. Writes on the replica fail."""
    primary, replica = _pg_primary_and_replica
    _starting(lambda: [primary.start(), replica.start()])
    primary_url = primary.create_database()
    name = make_url(primary_url).database or ""
    replica.wait_for_replay()
    yield ReplicaPair(primary_url, replica.url(name), replica.wait_for_replay)
    if primary.is_running:
        primary.drop_database(name)


# -- PgBouncer in front of test databases ------------------------------------------------------


@pytest.fixture
def pgbouncer() -> Iterator[Callable[..., PgBouncer]]:
    """Factory: ``pgbouncer(urls, pool_size=3)`` -> a started :class:`PgBouncer` in transaction
    mode in front of those databases (``.pooled_urls``, same order); stopped after the test.
    Missing or broken PgBouncer: skipped with the reason, a failure under ``CI=true``."""
    def unavailable(reason: str) -> None:
        message = f"PgBouncer is unavailable: {reason}"
        if _in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)

    reason = pgbouncer_unavailable_reason()
    if reason is not None:
        unavailable(reason)
    bouncers: list[PgBouncer] = []

    def make(urls: list[str], pool_size: int = DEFAULT_POOL_SIZE) -> PgBouncer:
        bouncer = PgBouncer(urls, pool_size=pool_size)
        bouncers.append(bouncer)
        try:
            bouncer.start()
        except (RuntimeError, OSError, TimeoutError) as exc:  # like a PostgreSQL that cannot start
            unavailable(f"{type(exc).__name__}: {exc}")
        return bouncer

    yield make
    for bouncer in bouncers:
        bouncer.close()


@pytest.fixture
def pg_route(request: pytest.FixtureRequest, pg_databases: Callable[[int], list[str]]) -> Direct | Pooling:
    """Where a suite's databases are reached: ``direct`` (the default), or ``pgbouncer`` (one
    transaction-mode PgBouncer in front of them, maps written with ``pooler: transaction`` and the
    ``direct:`` URL). ``support.pgbouncer.THROUGH_PGBOUNCER`` runs a test on both."""
    if getattr(request, "param", "direct") == "direct":
        return Direct(pg_databases)
    return Pooling(pg_databases, request.getfixturevalue("pgbouncer"))


# -- SQLite ------------------------------------------------------------------------------------


@pytest.fixture
def tmp_sqlite_urls(tmp_path: Path) -> Callable[[int], list[str]]:
    """Factory: ``tmp_sqlite_urls(n)`` -> n new ``sqlite:///<abs path>.db`` URLs in tmp_path."""
    made = 0

    def make(n: int = 1) -> list[str]:
        nonlocal made
        urls = [f"sqlite:///{tmp_path / f'db{made + index}.db'}" for index in range(n)]
        made += n
        return urls

    return make


@pytest.fixture
def mongo_env(tmp_path: Path) -> Iterator[MongoEnv]:
    """A MongoDB test environment: the in-process fake, or ``MDB_TEST_MONGO_URI`` (tests/support/mongo.py)."""
    env = MongoEnv.create(tmp_path)
    try:
        yield env
    finally:
        env.drop()
