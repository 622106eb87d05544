"""The ``mdb`` command. Each module below registers its commands on the shared typer app."""

from mdb.cli import inspect as _inspect  # noqa: F401  (registers commands)
from mdb.cli import schema_cmd as _schema_cmd  # noqa: F401
from mdb.cli import map_edit_cmd as _map_edit_cmd  # noqa: F401
from mdb.cli import gdid_cmd as _gdid_cmd  # noqa: F401
from mdb.cli import moves_cmd as _moves_cmd  # noqa: F401
from mdb.cli import central_cmd as _central_cmd  # noqa: F401
from mdb.cli import demo as _demo  # noqa: F401
from mdb.cli import mongo_cmd as _mongo_cmd  # noqa: F401
from mdb.cli import hot_cmd as _hot_cmd  # noqa: F401
from mdb.cli import fleet_cmd as _fleet_cmd  # noqa: F401
from mdb.cli import migrate_cmd as _migrate_cmd  # noqa: F401
from mdb.cli import status_cmd as _status_cmd  # noqa: F401
from mdb.cli.app import app, main, use_house_style

use_house_style(app)  # after every module registered its commands

__all__ = ["app", "main"]
