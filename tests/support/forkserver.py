"""The Python children of the tests, forked from a warm process instead of started cold.

Each ``mdb`` a test starts spent 60-85% of its CPU importing (docs/testing.md, "Where the time
goes"), and the fault suites start hundreds: a reshard killed at each of 16 steps and resumed is
32 processes. :func:`popen` and :func:`run` are ``subprocess.Popen`` and ``subprocess.run`` for
``python -c CODE ARGS`` and the ``mdb`` console script. They ask a *fork server* (one per pytest
process, started on first use) to fork a child from a process that already imported mdb and the
third-party libraries mdb uses (SQLAlchemy, psycopg, pydantic, typer, rich, Alembic, ...), as
multiprocessing's ``forkserver`` does.

What the child gets is what ``exec`` would give it: the caller's argv, environment, working
folder and stdin/stdout/stderr (passed as file descriptors over a Unix socket), default signal
handlers, a fresh ``__main__``, no other open descriptor. It is a real process: the test signals,
stops and SIGKILLs it by its pid; its exit status is the fork server's ``waitpid`` of it, sent back
over the socket, so ``poll()``, ``wait()``, ``communicate()`` and ``returncode`` are Popen's own.

The server imports what a full ``mdb`` CLI imports except ``mdb.cli`` (its console reads
``COLUMNS`` when created) and the test harness, with ``os.environ`` watched: a child whose
environment differs from the server's on a variable those imports read (OpenTelemetry's
provider choices, psycopg's implementation, ...), or on a ``PYTHON*`` variable, is started the
ordinary way; so is a call with options the server does not model (``preexec_fn``,
``pass_fds``, a new session, another user), and every child when ``MDB_TEST_FORKSERVER=0``.
docs/dev/0021 says why.
"""

from __future__ import annotations

import atexit
import builtins
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from types import CodeType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SWITCH_ENV = "MDB_TEST_FORKSERVER"
MDB_SCRIPT = Path(sys.executable).parent / "mdb"
"""The installed console script; started through the server as its own code would run."""
_MDB_SCRIPT_CODE = "import sys\nfrom mdb.cli import main\nsys.exit(main())\n"
_NOT_PRELOADED = ("mdb.cli", "mdb.testing", "support", "__main__")
"""Packages the server does not import ahead: the CLI (its console takes its width from
``COLUMNS`` when imported), the testing harness and the tests' helpers (they arm fault points,
start servers), the script itself."""
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "preexec_fn": (None,), "pass_fds": (None, ()), "start_new_session": (None, False), "process_group": (None, -1),
    "user": (None,), "group": (None,), "extra_groups": (None,), "umask": (None, -1), "shell": (None, False),
    "executable": (None,), "close_fds": (None, True), "restore_signals": (None, True),
}
"""Popen options the server models only at their defaults; a call with another value is started the ordinary way."""

_BOOT = (
    "import sys\n"
    "path = list(sys.path)\n"
    "sys.path.insert(0, 'tests')\n"
    "from support.forkserver import serve\n"
    "exec(serve(sys.argv[1], sys.argv[2], path))\n"
)
"""The server's own ``-c``: ``serve`` returns only in a forked child, with the child's code."""


# --- the client side (in the pytest process) ------------------------------------------------


class _Server:
    """A fork server of this pytest process: its process, the socket it listens on, what its imports read."""

    def __init__(self, env: dict[str, str]) -> None:
        self.folder = tempfile.mkdtemp(prefix="mdb-forkserver-")
        self.path = os.path.join(self.folder, "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, self.path, ",".join(_preload_list(env))],
            cwd=str(ROOT), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.process.stdout is not None
        ready = self.process.stdout.readline().strip()
        if not ready.startswith("ready "):
            self.process.kill()
            raise RuntimeError(f"the tests' fork server did not start: {ready!r} (exit {self.process.wait()})")
        read = json.loads(ready.split(" ", 1)[1])
        self.imported_with: dict[str, str | None] | None = None if "*" in read else {k: env.get(k) for k in read}
        """The environment variables its imports read, with the values they saw (None: unset, or
        the imports read all of it): a child whose environment differs there is started the ordinary way."""
        atexit.register(self.close)

    def accepts(self, env: Mapping[str, str]) -> bool:
        """Whether a child with ``env`` would import what the server imported the way it did."""
        return self.imported_with is not None and all(env.get(k) == v for k, v in self.imported_with.items())

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()  # the server exits at EOF on its stdin
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if os.path.exists(self.path):
            os.unlink(self.path)
        os.rmdir(self.folder)


_servers: dict[frozenset[tuple[str, str]], _Server] = {}
_servers_lock = threading.Lock()


def _server_for(env: dict[str, str]) -> _Server:
    """The server whose Python starts as a child with ``env`` would: one per set of ``PYTHON*`` variables
    (``PYTHONPATH`` decides ``sys.path``), started on first use."""
    key = frozenset((k, v) for k, v in env.items() if k.startswith("PYTHON"))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.process.poll() is not None:
            server = _servers[key] = _Server(env)
        return server


def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment a child gets: ``env`` as given, or this process's (Popen's ``env=None``)."""
    full = dict(os.environ if env is None else env)
    return full


def _preload_list(env: dict[str, str]) -> list[str]:
    """The third-party modules a full ``mdb`` CLI imports, in import order, as a fresh child sees them."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "from mdb.cli import load\n"
        "load()\n"
        "import mdb.demo.models, mdb.moves.batch, mdb.moves.reshard, mdb.fleet.fsck\n"
        "print(','.join(m for m in sys.modules if m not in before))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    names = done.stdout.strip().split(",")
    return [m for m in names if m and not any(m == p or m.startswith(p + ".") for p in _NOT_PRELOADED)]


class ForkedPopen(subprocess.Popen):
    """A ``Popen`` whose child is forked by ``server``; ``args`` as for ``python -c CODE ARGS``."""

    _status: socket.socket

    def __init__(self, args: Sequence[Any], *, server: _Server, **kwargs: Any) -> None:
        self._server = server
        super().__init__(args, **kwargs)

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any,
                       cwd: Any, env: Any, startupinfo: Any, creationflags: Any, shell: Any,
                       p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int, errread: int, errwrite: int,
                       *rest: Any) -> None:
        args = [os.fspath(a) for a in args]
        argv0, code = _code_of(args)
        env = _child_env(env)
        request = json.dumps({
            "code": code, "argv": [argv0, *args[3 if argv0 == "-c" else 1:]],
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(), "env": env,
        }).encode()
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self._server.path)
            socket.send_fds(conn, [request], fds)
            reply = conn.recv(4096).decode()
        except BaseException:
            conn.close()
            raise
        if not reply.startswith("pid "):
            conn.close()
            raise RuntimeError(f"the fork server could not start {args[:3]!r}: {reply or 'it closed the connection'}")
        self.pid = int(reply.split()[1])
        self._child_created = True
        self._status = conn
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]

    def _waitpid(self, pid: int, flags: int) -> tuple[int, int]:
        """``os.waitpid`` for a child of the fork server: its status arrives on the socket once reaped."""
        self._status.setblocking(not flags & os.WNOHANG)
        try:
            message = self._status.recv(64)
        except BlockingIOError:
            return 0, 0
        if not message:
            raise RuntimeError(f"the fork server went away before reporting how pid {pid} ended")
        self._status.close()
        return pid, int(message.split()[1])

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:
        # Popen's own, with the server's status for waitpid: written out because its parameters
        # differ between Python versions (``_waitpid`` in 3.11, ``_del_safe`` from 3.12).
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
                return None  # another thread is waiting for it
            try:
                if self.returncode is None:
                    pid, status = self._waitpid(self.pid, os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)  # type: ignore[attr-defined]
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        return self._waitpid(self.pid, wait_flags)


def _code_of(args: Sequence[str]) -> tuple[str, str]:
    """(argv[0], code) of a command the server can fork: ``python -c CODE ...`` or the ``mdb`` script."""
    if args[0] == str(MDB_SCRIPT):
        return args[0], _MDB_SCRIPT_CODE
    return "-c", args[2]


def _forkable(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    if os.environ.get(SWITCH_ENV, "1") == "0" or isinstance(args, (str, bytes)):
        return False
    words = [os.fspath(a) for a in args]
    if not all(isinstance(w, str) for w in words):
        return False  # a bytes argument (a non-UTF-8 argv) does not travel as JSON: exec it
    python_c = len(words) >= 3 and words[0] == sys.executable and words[1] == "-c"
    script = bool(words) and words[0] == str(MDB_SCRIPT)
    return (python_c or script) and all(kwargs.get(k) in _DEFAULTS[k] for k in _DEFAULTS)


def popen(args: Sequence[Any], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **kwargs)``, forked from the warm server where it can be."""
    if _forkable(args, kwargs):
        env = _child_env(kwargs.get("env"))
        server = _server_for(env)
        if server.accepts(env):
            return ForkedPopen(args, server=server, **kwargs)
    return subprocess.Popen(args, **kwargs)


def run(args: Sequence[Any], *, input: Any = None, capture_output: bool = False, timeout: float | None = None,
        check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` on :func:`popen`."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(args, **kwargs) as process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except BaseException:
            process.kill()
            process.wait()
            raise
    done = subprocess.CompletedProcess(args, process.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# --- the server side (its own process) ---------------------------------------------------------


def serve(path: str, modules: str, initial_path: list[str]) -> CodeType:
    """Import ``modules``, then fork a child per request on ``path`` until stdin closes.

    Returns only in a child, with the code it is to run (the caller ``exec``s it in ``__main__``).
    """
    watched = _WatchedEnviron(os.environ)
    os.environ = watched  # type: ignore[assignment]  # os.getenv reads the module's global too
    try:
        for name in filter(None, modules.split(",")):
            importlib.import_module(name)
    finally:
        os.environ = watched.environ  # type: ignore[assignment]
    if threading.active_count() != 1:
        raise RuntimeError(f"the fork server must not fork with threads running: {threading.enumerate()}")
    gc.collect()
    gc.freeze()  # the preloaded objects stay shared with the children (copy-on-write)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    selector.register(0, selectors.EVENT_READ, "stdin")
    waiting: dict[int, socket.socket] = {}
    print("ready " + json.dumps(sorted(watched.read)), flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(0, 4096):
                    sys.exit(0)  # the pytest process is done with us; the children live on
            elif key.data == "reap":
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                _reap(waiting)
            else:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
                try:
                    request = json.loads(message)
                    pid = os.fork()
                except BaseException as exc:
                    conn.send(f"error {exc!r}".encode())
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                if pid == 0:
                    selector.close()
                    listener.close()
                    conn.close()
                    for other in waiting.values():
                        other.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    return _become(request, fds, initial_path)
                for fd in fds:
                    os.close(fd)
                conn.send(f"pid {pid}".encode())
                waiting[pid] = conn
                _reap(waiting)  # a child that ended before it was registered


class _WatchedEnviron(MutableMapping[str, str]):
    """``os.environ`` as the preloaded modules see it while they import: which variables they read
    (``*``: all of them, by iterating)."""

    def __init__(self, environ: MutableMapping[str, str]) -> None:
        self.environ = environ
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return self.environ[key]

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return key in self.environ

    def __iter__(self) -> Iterator[str]:
        self.read.add("*")
        return iter(self.environ)

    def __len__(self) -> int:
        self.read.add("*")
        return len(self.environ)

    def __setitem__(self, key: str, value: str) -> None:
        self.environ[key] = value

    def __delitem__(self, key: str) -> None:
        del self.environ[key]

    def copy(self) -> dict[str, str]:
        self.read.add("*")
        return dict(self.environ)


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.send(f"status {status}".encode())
            except OSError:
                pass  # the test let go of its Popen: nobody is waiting for this status
            conn.close()


def _become(request: dict[str, Any], fds: list[int], initial_path: list[str]) -> CodeType:
    """In the forked child: take on the requester's descriptors, folder, environment and argv."""
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv[:] = request["argv"]
        sys.path[:] = initial_path
        for name in [m for m in sys.modules if m == "support" or m.startswith("support.")]:
            del sys.modules[name]
        main = sys.modules["__main__"].__dict__
        main.clear()
        main.update({"__name__": "__main__", "__builtins__": builtins, "__doc__": None, "__spec__": None,
                     "__loader__": None, "__package__": None})
        return compile(request["code"], "<string>", "exec")
    except BaseException:
        traceback.print_exc()
        os._exit(127)
