"""What many commands share, declared once: the MAP argument, ``--json``, ``--models``, a server progress bar.

typer reads a command's options from its parameters' annotations, so an option is declared once
here and named in each command's signature.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Protocol

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mdb.cli.app import err_console

__all__ = ["JsonOpt", "MapArg", "ModelsOpt", "server_progress"]

MapArg = Annotated[str, typer.Argument(metavar="MAP", help="partition map YAML")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
ModelsOpt = Annotated[
    list[str] | None,
    typer.Option("--models", metavar="MODULE", help="also import this module for briefcase types and CENTRAL indexes (repeatable)"),
]


class _OfServer(Protocol):
    """A per-server outcome (a schema report, a migration result): what the bar names as the last one done."""

    @property
    def server(self) -> str: ...


@contextmanager
def server_progress(what: str, total: int) -> Iterator[Callable[[_OfServer], None]]:
    """A progress bar over servers on stderr (a terminal only: stdout stays the report, or the JSON); yields ``on_done``."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console, transient=True, disable=not err_console.is_terminal)
    task = progress.add_task(what, total=total)

    def on_done(item: _OfServer) -> None:
        progress.update(task, advance=1, description=f"{what} (last: {item.server})")

    with progress:
        yield on_done
