"""The typer application and the few helpers every command module shares.

Command modules (one per topic) register on :data:`app` or one of its groups. Three things
live here so that every command behaves alike:

* **One truth about the map.** :func:`open_store` and :func:`open_map` are the only ways a
  command reads a map: the file, through the one hostile-input-safe loader, then the newest
  map ``mdb map apply`` recorded in CENTRAL when that is newer (what ``Store.refresh`` adopts),
  with one note on stderr when the file is older. Before, the CLI routed with the file while
  every Store routed with CENTRAL's map, so ``mdb route`` and ``mdb where`` named different
  servers after an apply.
* **Exit codes** (:func:`exit_code`, docs/cli.md): 0 done; 1 "not found" / "problems found";
  2 bad input or a refused operation; 3 a server is unavailable; 4 aborted safely, retry later;
  ``mdb status`` only: 5 attention, 6 broken.
* **One error line.** ``main`` turns every error mdb raises on purpose into one masked
  ``error:`` line on stderr, so operators and scripts never see a traceback.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version as package_version
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from sqlalchemy.exc import DBAPIError
from typer import Abort
from typer._click.exceptions import ClickException
from typer.core import TyperArgument, TyperCommand, TyperGroup
from typer.models import DefaultPlaceholder

from mdb import faults
from mdb.backends import servers_where
from mdb.cli import interrupts
from mdb.cli.interrupts import one_line
from mdb.dberrors import describe
from mdb.errors import MdbError, RetryableError, ServerUnavailableError
from mdb.maps.history import load_applied_map
from mdb.partition_map import PartitionMap, load_map, load_map_cached
from mdb.store import Store
from mdb.urls import mask_secrets

__all__ = [
    "EXIT_ATTENTION",
    "EXIT_BROKEN",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_RETRY",
    "EXIT_UNAVAILABLE",
    "app",
    "console",
    "emit_json",
    "err_console",
    "exit_code",
    "fail",
    "main",
    "map_app",
    "open_map",
    "open_store",
    "read_map_file",
    "use_house_style",
    "warn",
]

EXIT_OK = 0
EXIT_NOT_FOUND = 1
"""The command ran; the answer is "not found" or "problems found"."""
EXIT_REFUSED = 2
"""Bad input, or an operation mdb refuses (any non-retryable MdbError)."""
EXIT_UNAVAILABLE = 3
"""A server could not be reached."""
EXIT_RETRY = 4
"""Aborted safely (nothing half-done); running the same command later may succeed."""
EXIT_ATTENTION = 5
"""``mdb status``: the fleet serves, but an operator should act (an interrupted job, a mixed rollout, ...)."""
EXIT_BROKEN = 6
"""``mdb status``: the application is affected now (a partition frozen with nobody to unfreeze it, a server unreadable)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C, by the shell's convention (128 + SIGINT)."""
EXIT_TERMINATED = 143
"""SIGTERM (128 + 15): handled like Ctrl-C (a reshard stops after its batches, names what to run), then this code."""

CENTRAL_WAIT_SECONDS = 10.0
"""How long a command that needs no database waits for CENTRAL before using the file."""

# Piped into a file or a pager, rich would squeeze tables into 80 columns and cut GDIDs and
# emails short; a wide fixed width keeps every cell whole there (a terminal keeps its own width).
# emoji=False: rich would print the GDID "12:x:5" as "12❌5" and a key "tag:fire:1" as
# "tag🔥1"; ``markup=False`` does not turn emoji codes off, only this does.
console = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False, emoji=False)


# -- help text: usage "mdb route MAP AREA GDID", flags without a "<bool>" type -------------------


def _usage_pieces(command: Any, ctx: Any) -> list[str]:
    """``[OPTIONS] MAP AREA GDID``: typer 0.29 would print ``{MAP} {area} {gdid}``."""
    pieces: list[str] = [command.options_metavar] if command.options_metavar else []
    for param in command.get_params(ctx):
        if isinstance(param, TyperArgument):
            name = (param.metavar or param.name or "ARG").upper()
            name = name if param.required else f"[{name}]"
            pieces.append(name + ("..." if param.nargs != 1 else ""))
        else:
            pieces.extend(param.get_usage_pieces(ctx))
    return pieces


class _HouseStyle:
    """Help-text fixes shared by commands and groups."""

    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""  # a flag takes no value: no "<bool>" after it
        return params


class MdbCommand(_HouseStyle, TyperCommand):
    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return _usage_pieces(self, ctx)


class MdbGroup(_HouseStyle, TyperGroup):
    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [*_usage_pieces(self, ctx), self.subcommand_metavar or "COMMAND [ARGS]..."]


class DefaultCommandGroup(MdbGroup):
    """A group whose unknown first word is handed to a default subcommand (``mdb gdid VALUE``)."""

    default_command = "show"

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple[Any, Any, list[str]]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = [self.default_command, *args]
        return super().resolve_command(ctx, args)


def use_house_style(typer_app: typer.Typer) -> None:
    """Give every command and group registered so far that did not choose a class ours."""
    for command in typer_app.registered_commands:
        if command.cls in (None, TyperCommand) or isinstance(command.cls, DefaultPlaceholder):
            command.cls = MdbCommand
    for group in typer_app.registered_groups:
        sub = group.typer_instance
        if sub is None:
            continue
        chosen = [c for c in (group.cls, sub.info.cls) if c not in (None, TyperGroup) and not isinstance(c, DefaultPlaceholder)]
        if not chosen:
            group.cls = MdbGroup
        use_house_style(sub)


app = typer.Typer(
    name="mdb",
    cls=MdbGroup,
    help="mdb: briefcases of relational data routed over many database servers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
map_app = typer.Typer(cls=MdbGroup, help="Check, show, pull, diff and apply partition maps.", no_args_is_help=True)
app.add_typer(map_app, name="map")


def _version() -> str:
    try:
        return package_version("mdb")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        console.print(f"mdb {_version()}", markup=False)
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    show_version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print mdb's version and exit.")
    ] = False,
) -> None:
    """mdb: briefcases of relational data routed over many database servers."""


# -- output helpers ------------------------------------------------------------------------------


def fail(message: str) -> NoReturn:
    """Bad input: one error line, exit 2."""
    _error_line(message)
    raise typer.Exit(EXIT_REFUSED)


def warn(message: str) -> None:
    """One masked ``note:`` line on stderr (never on stdout, which scripts parse)."""
    err_console.print(f"note: {mask_secrets(one_line(message))}", markup=False, soft_wrap=True)


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _error_line(message: str) -> None:
    err_console.print(f"error: {mask_secrets(one_line(message))}", markup=False, soft_wrap=True)


# -- one truth about the map ---------------------------------------------------------------------


def read_map_file(path: str) -> PartitionMap:
    """The map file exactly as written (validated): for ``map check`` and a NEW map to apply."""
    return load_map(path)


def _newest_map(pmap: PartitionMap, map_path: str) -> PartitionMap:
    """``pmap``, or the newer map applied in CENTRAL: what ``Store.refresh`` adopts."""
    probe = Store(pmap, types=[], map_path=map_path)
    try:
        applied = load_applied_map(probe, pmap)
    finally:
        probe.close()
    if applied is None:
        return pmap
    warn(f"map file {map_path} is v{pmap.version}; the system runs v{applied.version} "
         f"(`mdb map pull {map_path} -o {map_path}` updates it)")
    return applied


T = TypeVar("T")


def _within(seconds: float, work: Callable[[], T]) -> T:
    """``work()``, or TimeoutError after ``seconds``: a CENTRAL that drops packets must not hang
    a command that can answer from the file. The worker is a daemon thread, left to finish."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the caller below, never dropped
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="mdb-central-probe", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"CENTRAL did not answer within {seconds:g} s")
    if "error" in outcome:
        raise outcome["error"]
    value: T = outcome["value"]
    return value


def open_map(map_path: str) -> PartitionMap:
    """The map the system runs, for commands that need no database (``route``, ``map show``).

    The newest applied map when CENTRAL answers; when it does not (down, unreachable, slower
    than :data:`CENTRAL_WAIT_SECONDS`), the file, with a note saying so.
    """
    pmap = load_map(map_path)
    try:
        return _within(CENTRAL_WAIT_SECONDS, lambda: _newest_map(pmap, map_path))
    except (MdbError, DBAPIError, TimeoutError) as exc:
        warn(f"cannot read the applied map from CENTRAL ({exc}); using map file {map_path} v{pmap.version} as written")
        return pmap


def import_models(modules: list[str], map_path: str | None = None) -> None:
    """Import the modules that declare briefcase types, so they register; a bad name fails clearly.

    The current folder is on the import path, as it is for ``python -m``: an application run
    from its own folder names ``myapp.models`` and it is found without setting PYTHONPATH (a
    console script, unlike ``python``, does not put the current folder there). So is the map
    file's folder, after it: a map kept beside its application is found from any folder, as its
    relative SQLite paths are.
    """
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)
    folders = [here]
    if map_path is not None:
        beside = str(Path(map_path).resolve().parent)
        if beside not in folders:
            folders.append(beside)
            if beside not in sys.path:
                sys.path.append(beside)  # after the current folder and PYTHONPATH: those win
    for module in dict.fromkeys(modules):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            fail(f"cannot import models module {module!r}: {exc} (looked in {' and '.join(folders)} and on PYTHONPATH)")


def open_store(map_path: str, models: Sequence[str] | None = None, *, tool: bool = False, **kwargs: Any) -> Store:
    """A Store on the map the system runs, for every command that talks to the servers.

    Imports the map's ``models:`` and ``models`` (so briefcase types register) unless
    ``types`` is given. A CENTRAL that cannot be reached is an error here (exit 3). ``tool``:
    an operator tool (moves, schema, map apply) that connects past a transaction pooler where
    the map gives a server a ``direct:`` URL (docs/operations.md).
    """
    pmap = _newest_map(load_map_cached(map_path), map_path)  # the Store's first refresh reuses this parse
    if "types" not in kwargs:
        from mdb.briefcase import registered_types

        import_models([*pmap.models, *(models or [])], map_path)
        kwargs["types"] = registered_types()
    store = Store(pmap, map_path=map_path, **kwargs)
    if tool:
        store.engines.use_direct()
    if faults.armed() and servers_where(store.map, lambda b: b.holds_documents):
        from mdb.testing.mongo import attach_fake_dir  # the test harness's file-backed fake (MDB_MONGO_FAKE_DIR)

        attach_fake_dir(store)
    return store


# -- running -------------------------------------------------------------------------------------


def exit_code(exc: MdbError) -> int:
    """The exit code of an error mdb raised on purpose (docs/cli.md)."""
    if isinstance(exc, ServerUnavailableError):
        return EXIT_UNAVAILABLE
    if isinstance(exc, RetryableError):
        return EXIT_RETRY
    return EXIT_REFUSED


def main() -> None:
    """Run the CLI: every error mdb raises on purpose ends in one ``error:`` line and its exit code."""
    interrupts.install()
    try:
        code = app(standalone_mode=False)
        if code == EXIT_INTERRUPTED and interrupts.terminated():
            code = EXIT_TERMINATED
    except MdbError as exc:
        _error_line(str(exc))
        sys.exit(exit_code(exc))
    except ClickException as exc:
        message = exc.format_message()
        if message:  # an empty one is "no arguments": the help text was already shown
            ctx = getattr(exc, "ctx", None)
            _error_line(message + (f" (see: {ctx.command_path} --help)" if ctx is not None else ""))
        sys.exit(EXIT_REFUSED)
    except DBAPIError as exc:  # a driver error no `translated` block knew: still one masked line, never a traceback
        _error_line(f"database error: {describe(exc)}")
        sys.exit(EXIT_REFUSED)
    except Abort:
        _error_line("aborted")
        sys.exit(EXIT_TERMINATED if interrupts.terminated() else EXIT_INTERRUPTED)
    except KeyboardInterrupt:  # a signal while typer was still building the command, outside click's own handler
        sys.exit(EXIT_TERMINATED if interrupts.terminated() else EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else EXIT_OK)
