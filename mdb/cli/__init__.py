"""The ``mdb`` command. Each module below registers its commands on the shared typer app.

``mdb COMMAND`` imports only the module(s) that register COMMAND (:data:`COMMANDS`), so a
command's start-up does not pay for every other command's imports (alembic for ``schema`` and
``migrate``, the fleet tools, CENTRAL repair, the demos): the CLI's start-up is most of a short
command's time, and the test suite starts it hundreds of times. ``mdb`` alone, ``mdb --help``
and an unknown word load them all (the full help, "did you mean"), as does ``from mdb.cli import
app`` (the complete typer app: tests drive it with typer's runner).
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

    app: typer.Typer

MODULES = (
    "inspect", "schema_cmd", "map_edit_cmd", "gdid_cmd", "moves_cmd", "central_cmd", "demo", "mongo_cmd",
    "hot_cmd", "fleet_cmd", "migrate_cmd", "status_cmd",
)
"""Every command module under ``mdb.cli``, in the order the help lists their commands."""

COMMANDS: dict[str, tuple[str, ...]] = {
    "route": ("inspect",),
    "central-shard": ("inspect",),
    "map": ("inspect", "map_edit_cmd"),
    "gdid": ("inspect", "gdid_cmd"),
    "schema": ("schema_cmd",),
    "move": ("moves_cmd",),
    "where": ("moves_cmd",),
    "reshard": ("moves_cmd",),
    "worker": ("moves_cmd",),
    "moves": ("moves_cmd", "status_cmd"),
    "central": ("central_cmd",),
    "demo": ("demo",),
    "demo-documents": ("mongo_cmd",),
    "snapshot": ("hot_cmd",),
    "balance": ("fleet_cmd",),
    "fsck": ("fleet_cmd",),
    "rebalance": ("fleet_cmd",),
    "drain": ("fleet_cmd",),
    "migrate": ("migrate_cmd",),
    "status": ("status_cmd",),
    "serve-metrics": ("status_cmd",),
}
"""Top-level command or group -> the modules that register it or its subcommands
(tests/unit/test_cli_commands.py checks this against what the modules register)."""

__all__ = ["COMMANDS", "MODULES", "app", "load", "main"]


def load(modules: Iterable[str] = MODULES) -> typer.Typer:
    """Import these command modules (the rest stay unloaded) and give their commands the house style."""
    app_module = importlib.import_module("mdb.cli.app")
    for name in modules:
        importlib.import_module(f"mdb.cli.{name}")
    app_module.use_house_style(app_module.app)  # idempotent: only commands that have no class yet
    typer_app: typer.Typer = app_module.app
    return typer_app


def modules_for(argv: Sequence[str]) -> tuple[str, ...]:
    """The command modules ``mdb *argv`` needs: its command's, or all when it names none we know."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return COMMANDS.get(word, MODULES) if word is not None else MODULES


def main() -> None:
    """The ``mdb`` entry point: load what the command line's command needs, then run it.

    The cyclic garbage collector is off while the modules load and their objects are frozen
    afterwards (``gc.freeze``): they live as long as the process, yet the collector scanned them
    again and again as the heap grew during the imports, then once more at exit. py-spy of a
    ``mdb moves resume``: about 0.9 s in collections during the imports and 0.7 s at exit, a
    quarter of its samples. What the command allocates is collected as usual. Only when this
    call is the process's start-up (the CLI not loaded yet): a program or test that runs
    ``main()`` in its own process keeps its collector as it is.
    """
    starting = "mdb.cli.app" not in sys.modules
    if starting:
        gc.disable()
    try:
        load(modules_for(sys.argv[1:]))
    finally:
        if starting:
            gc.freeze()
            gc.enable()
    importlib.import_module("mdb.cli.app").main()


class _Package(ModuleType):
    """``mdb.cli.app`` is the complete Typer app (every command module loaded on first use), as it
    was when this package imported them all; the submodule of that name is ``sys.modules["mdb.cli.app"]``."""

    @property
    def app(self) -> typer.Typer:
        return load(MODULES)

    @app.setter
    def app(self, value: Any) -> None:
        """The import system binds the submodule ``mdb.cli.app`` here when it loads it: keep the property."""


sys.modules[__name__].__class__ = _Package
