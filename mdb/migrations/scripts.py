"""Where an area's migration history lives, and writing a new revision (``mdb migrate revision``).

One Alembic script directory per area, ``migrations/<area>/`` beside the map file by default
(the map is what an operator checks in with the application; its relative paths already
resolve beside it), or under the folder ``--scripts`` names. Each directory is an ordinary
Alembic script directory: ``versions/*.py`` revisions, ``script.py.mako`` (Alembic's generic
template), and an ``alembic.ini`` + ``env.py`` that let a person run the history by hand on one
database (``alembic -c migrations/user/alembic.ini -x url=... upgrade head``). mdb itself
drives Alembic from Python (:mod:`mdb.migrations.fleet`) and never runs ``env.py``.

Autogenerate compares the models of the area's briefcase types with one reference shard, and
looks at those tables only: mdb's own tables, other areas' tables and the version tables are
never in a generated revision (an ``include_object`` filter), so a revision can never drop
``mdb_shard_layout``.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import alembic
from alembic.autogenerate import RevisionContext
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import MetaData, Table
from sqlalchemy.engine import Connection

from mdb.backends import backend_of
from mdb.cluster import Cluster
from mdb.errors import MigrationError
from mdb.migrations.revisions import stamp_revision, version_table

__all__ = ["area_dir", "area_tables", "make_revision", "one_head", "open_history", "scripts_root", "stamp_created"]

_ENV_PY = '''"""Run this area's history by hand on ONE database: alembic -c alembic.ini -x url=URL upgrade head.

`mdb migrate up MAP` does the same on every server of the area (canary first, in parallel, with
a lock timeout and a ledger) and does not use this file.
"""

from alembic import context
from sqlalchemy import create_engine

VERSION_TABLE = {version_table!r}

engine = create_engine(context.get_x_argument(as_dictionary=True)["url"])
with engine.connect() as connection:
    context.configure(connection=connection, version_table=VERSION_TABLE, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
'''

_ALEMBIC_INI = """# This area's history, for running it by hand on one database (see env.py).
[alembic]
script_location = %(here)s
"""


def scripts_root(map_path: Path | None, root: str | Path | None = None) -> Path:
    """The folder holding one history per area: ``root``, else ``migrations/`` beside the map file."""
    if root is not None:
        return Path(root)
    if map_path is None:
        raise MigrationError("no folder for the migration histories: give --scripts DIR (the map was not read from a file)")
    return map_path.resolve().parent / "migrations"


def area_dir(root: Path, area: str) -> Path:
    return root / area


def _config(directory: Path) -> Config:
    config = Config()
    config.set_main_option("script_location", str(directory))
    return config


def _create(directory: Path, area: str) -> None:
    """An empty Alembic script directory for ``area`` (what ``alembic init`` makes, minus its ini noise)."""
    (directory / "versions").mkdir(parents=True, exist_ok=True)
    template = Path(alembic.__file__).parent / "templates" / "generic" / "script.py.mako"
    if not (directory / "script.py.mako").exists():
        shutil.copyfile(template, directory / "script.py.mako")
    if not (directory / "env.py").exists():
        (directory / "env.py").write_text(_ENV_PY.format(version_table=version_table(area)), encoding="utf-8")
    if not (directory / "alembic.ini").exists():
        (directory / "alembic.ini").write_text(_ALEMBIC_INI, encoding="utf-8")


def open_history(root: Path, area: str, *, create: bool = False) -> ScriptDirectory:
    """The area's script directory; ``create`` makes an empty one where there is none.

    Its revision map is built here, in the calling thread, so that the worker threads of a
    rollout share a finished, read-only map (Alembic builds it lazily and not under a lock).
    """
    directory = area_dir(root, area)
    if create:
        _create(directory, area)
    elif not (directory / "versions").is_dir():
        raise MigrationError(
            f"area {area!r} has no migration history at {directory} (write the first revision: mdb migrate revision MAP {area} -m MSG)"
        )
    script = ScriptDirectory.from_config(_config(directory))
    try:
        script.get_heads()  # builds the revision map now; a broken history fails here, named
    except CommandError as exc:
        raise MigrationError(f"area {area!r}: the migration history at {directory} is broken: {exc}") from exc
    except SyntaxError as exc:  # Alembic imports every revision file to read its ids
        raise MigrationError(
            f"area {area!r}: revision file {exc.filename}, line {exc.lineno}: {exc.msg} (fix the file; no server was touched)"
        ) from exc
    except Exception as exc:  # the file's module-level code failed (a bad import, a NameError): application code
        raise MigrationError(
            f"area {area!r}: a revision file under {directory / 'versions'} failed to load: {type(exc).__name__}: {exc} "
            "(fix the file; no server was touched)"
        ) from exc
    return script


def area_tables(cluster: Cluster, area: str) -> list[Table]:
    """The tables of ``area``'s briefcase types: what the area's history migrates."""
    return [table for btype in cluster.types_of(area) for table in btype.tables]


def include_only(names: set[str]) -> Any:
    """An Alembic ``include_object`` that sees the tables ``names`` (and their columns, indexes) only."""

    def include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "table":
            return name in names
        table = getattr(obj, "table", None)
        return table is None or getattr(table, "name", None) in names

    return include


def make_revision(
    cluster: Cluster, root: Path, area: str, message: str, *, autogenerate: bool = False, reference: str | None = None
) -> list[Path]:
    """Write a new revision of ``area``'s history; returns the files written.

    With ``autogenerate`` the operations are what the models of the area's briefcase types need
    beyond the tables on ``reference`` (default: the area's first shard), which must be at the
    head of the history (Alembic refuses otherwise: a revision written against an old schema
    would repeat what a pending one does). Review the file before rolling it out.
    """
    if area not in cluster.router.area_names():
        raise MigrationError(f"unknown area {area!r} (the map has {', '.join(cluster.router.area_names())})")
    script = open_history(root, area, create=True)
    args = dict(message=message, autogenerate=autogenerate, sql=False, head="head", splice=False, branch_label=None,
                version_path=None, rev_id=None, depends_on=None)
    revision_context = RevisionContext(_config(area_dir(root, area)), script, args)
    if autogenerate:
        tables = area_tables(cluster, area)
        if not tables:
            raise MigrationError(f"area {area!r}: no briefcase types are known (list their modules under models: in the map, or --models)")
        server = reference or cluster.router.area_servers(area)[0]
        if not backend_of(cluster.map, server).follows_histories:
            raise MigrationError(f"reference server {server!r} is not a SQL server")
        metadatas: list[MetaData] = list(dict.fromkeys(t.metadata for t in tables))
        def retrieve(revision: Any, context: MigrationContext) -> list[Any]:
            revision_context.run_autogenerate(revision, context)
            return []

        config = _config(area_dir(root, area))
        with cluster.transaction(server) as conn, EnvironmentContext(
            config, script, fn=retrieve, template_args=revision_context.template_args, revision_context=revision_context
        ) as environment:
            environment.configure(
                connection=conn, version_table=version_table(area), target_metadata=metadatas,
                include_object=include_only({t.name for t in tables}), compare_type=True,
            )
            try:
                environment.run_migrations()
            except CommandError as exc:
                raise MigrationError(f"area {area!r}: reference shard {server!r}: {exc} (bring it to head first: mdb migrate up MAP)") from exc
    return [Path(s.path) for s in revision_context.generate_scripts() if s is not None]


def one_head(script: ScriptDirectory, area: str) -> str | None:
    """The head of ``area``'s history (None: no revision yet); several heads are refused."""
    heads = script.get_heads()
    if len(heads) > 1:
        raise MigrationError(f"area {area!r}: the history has several heads ({', '.join(heads)}): merge them first (alembic merge)")
    return heads[0] if heads else None


def stamp_created(conn: Connection, root: Path, area: str, tables: list[str], created: list[str]) -> str | None:
    """After ``schema apply`` created ``area``'s tables on a server from the models: record head there.

    The models are the head of the history (a model change ships with its revision), so a
    server whose area tables were all created just now is at head, and running the history on
    it would add columns that exist. A server where only some were created (or none) is left
    alone: ``mdb migrate status`` shows it. Returns the revision stamped, None when nothing was
    (no history for the area, or the tables were not all new).
    """
    if not tables or not set(tables) <= set(created) or not (area_dir(root, area) / "versions").is_dir():
        return None
    head = one_head(open_history(root, area), area)
    if head is not None:
        stamp_revision(conn, area, head)
    return head


def stamp_new_servers(cluster: Cluster, created: Mapping[str, Sequence[str]], root: Path) -> list[tuple[str, str, str]]:
    """After ``mdb schema apply``: record head on every SQL server where an area's tables were all created just now.

    ``created``: server -> the tables schema apply created there. A new or spare server built
    from the models is at the head of each area's history (:func:`stamp_created`); without the
    stamp, ``mdb migrate up`` would run every revision on it and fail on columns that exist.
    Returns (server, area, revision) for each stamp written.
    """
    done: list[tuple[str, str, str]] = []
    for server, tables in created.items():
        if not tables or not backend_of(cluster.map, server).follows_histories:
            continue
        for area in cluster.map.areas:
            names = [t.name for t in area_tables(cluster, area)]
            if not names or not set(names) <= set(tables):
                continue
            with cluster.transaction(server) as conn:
                head = stamp_created(conn, root, area, names, list(tables))
            if head is not None:
                done.append((server, area, head))
    return done
