"""A real, throwaway PgBouncer in front of test PostgreSQL databases (transaction pooling).

mdb promises that every guarantee holds behind a transaction-pooling pooler (docs/operations.md,
"Behind PgBouncer"); that only means something against the real one, with a pool small enough
that client connections really share server connections. So tests and ``tools/`` start
``pgbouncer`` from the system package (Debian: ``/usr/sbin/pgbouncer``) in the foreground on a
free port, with ``auth_type = trust`` on 127.0.0.1. PgBouncer refuses to run as root, so as root
it runs through ``setpriv`` as the same unprivileged user as the PostgreSQL test servers. Every
PgBouncer still running at interpreter exit is stopped and its files removed.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import psycopg
from sqlalchemy.engine import URL, make_url

from mdb.testing.postgres import HOST, _command_prefix, _make_owned_temp_dir, _unprivileged_user, binary_unavailable_reason

__all__ = ["DEFAULT_POOL_SIZE", "PgBouncer", "find_pgbouncer", "pgbouncer_unavailable_reason"]

DEFAULT_POOL_SIZE = 3
"""Server connections per database: small, so that sessions of several threads share them."""
_BOOT_TIMEOUT = 30.0
_CANDIDATES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer")


def find_pgbouncer() -> Path | None:
    """``MDB_PGBOUNCER`` when set, else ``pgbouncer`` on PATH, else the Debian location."""
    override = os.environ.get("MDB_PGBOUNCER")
    if override:
        return Path(override) if os.access(override, os.X_OK) else None
    on_path = shutil.which("pgbouncer")
    if on_path:
        return Path(on_path)
    return next((Path(p) for p in _CANDIDATES if os.access(p, os.X_OK)), None)


def pgbouncer_unavailable_reason() -> str | None:
    """Why no PgBouncer can be started here, or ``None`` if nothing is known against it."""
    binary = find_pgbouncer()
    if binary is None:
        override = os.environ.get("MDB_PGBOUNCER")
        if override:
            return f"no pgbouncer binary at MDB_PGBOUNCER={override}"
        return "no pgbouncer binary on PATH or in /usr/sbin; install the 'pgbouncer' system package"
    return binary_unavailable_reason(binary, "PgBouncer")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


_running: dict[int, PgBouncer] = {}
_running_lock = threading.Lock()


class PgBouncer:
    """One PgBouncer in transaction mode in front of the databases of ``urls``.

    ``pooled_urls`` are the same databases through it, in the same order (same user, same
    database name, PgBouncer's port). ``pool_size`` server connections per database at most:
    a client waits for one while all are inside transactions.
    """

    def __init__(self, urls: Sequence[str], *, pool_size: int = DEFAULT_POOL_SIZE, pool_mode: str = "transaction") -> None:
        binary = find_pgbouncer()
        if binary is None:
            raise RuntimeError(pgbouncer_unavailable_reason() or "no pgbouncer binary found")
        self.binary = binary
        self.pool_size = pool_size
        self.pool_mode = pool_mode
        self.port: int | None = None
        self._user = _unprivileged_user()
        self._process: subprocess.Popen[bytes] | None = None
        self._owner_pid = os.getpid()
        self.base_dir = _make_owned_temp_dir("mdb-pgbouncer-", self._user)
        self._targets: list[URL] = []
        self._add_targets(urls)
        with _running_lock:
            _running[id(self)] = self

    def __repr__(self) -> str:
        return f"PgBouncer(port={self.port}, pool_mode={self.pool_mode}, pool_size={self.pool_size}, running={self.is_running})"

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _add_targets(self, urls: Sequence[str]) -> None:
        targets = [*self._targets, *(make_url(url) for url in urls)]
        names = [u.database or "" for u in targets]
        if len(set(names)) != len(names) or "" in names or "pgbouncer" in names:
            raise ValueError(f"PgBouncer needs distinct database names other than 'pgbouncer', got {names}")
        self._targets = targets

    def add(self, urls: Sequence[str]) -> list[str]:
        """Put more databases behind the running PgBouncer (config rewritten, then ``RELOAD``);
        returns their pooled URLs."""
        self._add_targets(urls)
        if self.port is None:
            raise RuntimeError(f"{self!r} has no port yet: start() it first")
        (self.base_dir / "pgbouncer.ini").write_text(self._config(self.port))
        with self._admin() as conn:
            conn.execute("RELOAD")
        return self.pooled_urls[-len(urls):] if urls else []

    def _admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(host=HOST, port=self.port, dbname="pgbouncer", user=self._admin_user(),
                               autocommit=True, connect_timeout=5, prepare_threshold=None)

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pooled_urls(self) -> list[str]:
        if self.port is None:
            raise RuntimeError(f"{self!r} has no port yet: start() it first")
        return [u.set(host=HOST, port=self.port).render_as_string(hide_password=False) for u in self._targets]

    def _config(self, port: int) -> str:
        databases = "\n".join(
            f"{u.database} = host={u.host or HOST} port={u.port or 5432} dbname={u.database}" for u in self._targets
        )
        users = {u.username or "postgres" for u in self._targets}
        (self.base_dir / "users.txt").write_text("".join(f'"{name}" ""\n' for name in sorted(users)))
        return f"""[databases]
{databases}

[pgbouncer]
listen_addr = {HOST}
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {self.base_dir / "users.txt"}
admin_users = {", ".join(sorted(users))}
pool_mode = {self.pool_mode}
default_pool_size = {self.pool_size}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 2000
max_db_connections = 0
query_wait_timeout = 120
server_idle_timeout = 600
logfile =
pidfile =
"""

    def start(self) -> PgBouncer:
        """Start PgBouncer on a free port and wait until it accepts connections."""
        if self.is_running:
            return self
        port = self.port or _free_port()
        config = self.base_dir / "pgbouncer.ini"
        config.write_text(self._config(port))
        if self._user is not None:
            for path in self.base_dir.iterdir():
                os.chown(path, self._user.pw_uid, self._user.pw_gid)
        command = [*_command_prefix(self._user), str(self.binary), str(config)]
        # Its log goes to stderr in the foreground: into a file, never a pipe nobody drains.
        with open(self.base_dir / "pgbouncer.log", "ab") as log:
            self._process = subprocess.Popen(command, cwd=self.base_dir, stdout=log, stderr=subprocess.STDOUT)
        self.port = port
        self._wait_until_ready()
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + _BOOT_TIMEOUT
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited at start ({self._process.returncode}): {self._log_tail()}")
            try:
                # The admin console answers without a server connection: ready means listening.
                with self._admin() as conn:
                    conn.execute("SHOW VERSION")
                return
            except psycopg.OperationalError as exc:
                last = exc
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"pgbouncer did not accept connections on port {self.port} within {_BOOT_TIMEOUT} s: {last}")

    def _admin_user(self) -> str:
        return (self._targets[0].username if self._targets else None) or "postgres"

    def _log_tail(self) -> str:
        log = self.base_dir / "pgbouncer.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def show(self, what: str) -> list[dict[str, object]]:
        """Rows of an admin console ``SHOW <what>`` (``POOLS``, ``STATS``...), as dicts."""
        with self._admin() as conn:
            cursor = conn.execute(f"SHOW {what}")
            names = [c.name for c in cursor.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def stop(self) -> None:
        """Shut PgBouncer down at once (SIGTERM: clients are cut off) and wait until it has exited."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def close(self) -> None:
        """Stop and delete the files; again is a no-op."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            with _running_lock:
                _running.pop(id(self), None)


def _close_all_at_exit() -> None:
    with _running_lock:
        bouncers = [b for b in _running.values() if b._owner_pid == os.getpid()]
    for bouncer in bouncers:
        bouncer.close()


atexit.register(_close_all_at_exit)
