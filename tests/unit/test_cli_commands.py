"""``mdb COMMAND`` loads only COMMAND's modules (mdb.cli.COMMANDS): the table must name every
module that registers a command, or that command would be missing when it is run alone."""

from __future__ import annotations

import subprocess
import sys

import typer
import typer.main

import mdb.cli
from mdb.cli import COMMANDS, MODULES, app, modules_for


def _modules_of(group: typer.Typer) -> set[str]:
    found = {c.callback.__module__ for c in group.registered_commands if c.callback is not None}
    if group.registered_callback is not None and group.registered_callback.callback is not None:
        found.add(group.registered_callback.callback.__module__)
    for sub in group.registered_groups:
        assert sub.typer_instance is not None
        found |= _modules_of(sub.typer_instance)
    return found


def test_the_table_names_every_command_and_the_modules_that_register_it() -> None:
    registered: dict[str, set[str]] = {}
    for command in app.registered_commands:
        assert command.callback is not None
        name = command.name or typer.main.get_command_name(command.callback.__name__)
        registered.setdefault(name, set()).add(command.callback.__module__)
    for group in app.registered_groups:
        assert group.name is not None and group.typer_instance is not None
        registered.setdefault(group.name, set()).update(_modules_of(group.typer_instance))
    expected = {name: {f"mdb.cli.{m}" for m in modules} for name, modules in COMMANDS.items()}
    assert registered == expected
    assert {m for modules in COMMANDS.values() for m in modules} == set(MODULES)


def test_a_command_word_picks_its_modules_and_anything_else_loads_all() -> None:
    assert modules_for(["reshard", "map.yaml", "user", "--shards", "a,b"]) == ("moves_cmd",)
    assert modules_for(["--version"]) == MODULES
    assert modules_for([]) == MODULES
    assert modules_for(["no-such-command"]) == MODULES
    assert mdb.cli.app is app  # the attribute stays the complete Typer app, not the submodule of that name


def test_mdb_route_imports_neither_the_other_commands_nor_alembic() -> None:
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(sorted(m for m in sys.modules if m.startswith(('mdb.cli.', 'alembic')))))\n"
        "sys.argv = ['mdb', 'route', '--help']\n"
        "from mdb.cli import main\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(["mdb.cli.app", "mdb.cli.inspect", "mdb.cli.interrupts", "mdb.cli.options"]), done.stdout[-500:]
