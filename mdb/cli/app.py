"""The typer application and the few helpers every command module shares.

Command modules (one per topic) register on :data:`app` or one of its groups; ``main`` turns
every error mdb raises on purpose into one clear line on stderr and exit code 2, so operators
and scripts never see a traceback for bad input or a server that is down.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from typer import Abort
from typer._click.exceptions import ClickException
from typer.core import TyperGroup

from mdb.errors import MdbError
from mdb.partition_map import PartitionMap, load_map
from mdb.urls import mask_secrets

__all__ = ["app", "console", "err_console", "emit_json", "fail", "main", "map_app", "open_map"]

# Piped into a file or a pager, rich would squeeze tables into 80 columns and cut GDIDs and
# emails short; a wide fixed width keeps every cell whole there (a terminal keeps its own width).
# emoji=False: rich would print the GDID "12:x:5" as "12❌5" and a key "tag:fire:1" as
# "tag🔥1"; ``markup=False`` does not turn emoji codes off, only this does.
console = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False, emoji=False)


class DefaultCommandGroup(TyperGroup):
    """A group whose unknown first word is handed to a default subcommand (``mdb gdid VALUE``)."""

    default_command = "show"

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple[Any, Any, list[str]]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = [self.default_command, *args]
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="mdb",
    help="mdb: briefcases of relational data routed over many database servers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
map_app = typer.Typer(help="Check, show, diff and apply partition maps.", no_args_is_help=True)
app.add_typer(map_app, name="map")


def fail(message: str) -> NoReturn:
    _error_line(message)
    raise typer.Exit(2)


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def open_map(path: str) -> PartitionMap:
    return load_map(path)


def _error_line(message: str) -> None:
    err_console.print(f"error: {mask_secrets(message)}", markup=False, soft_wrap=True)


def main() -> None:
    """Run the CLI: bad input and unreachable servers end in one ``error:`` line and exit 2."""
    try:
        code = app(standalone_mode=False)
    except MdbError as exc:
        _error_line(str(exc))
        sys.exit(2)
    except ClickException as exc:
        message = exc.format_message()
        if message:  # an empty one is "no arguments": the help text was already shown
            ctx = getattr(exc, "ctx", None)
            _error_line(message + (f" (see: {ctx.command_path} --help)" if ctx is not None else ""))
        sys.exit(2)
    except Abort:
        _error_line("aborted")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
