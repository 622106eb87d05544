"""The partition map: versioned YAML describing servers, areas, partitions and range sets.

Loading starts with the bytes, because a map file is input mdb does not control: the file is
read up to :data:`MAX_MAP_BYTES`, decoded as strict UTF-8 (an error names the byte offset), and
composed by a YAML loader that refuses nesting deeper than :data:`MAX_DEPTH` and aliases that
would expand past :data:`MAX_ALIAS_NODES` nodes, *before* anything is expanded (a 400-byte
"billion laughs" file otherwise grows ~9x per level: seven levels took 14 s and 1.3 GB). Every
one of these ends as one :class:`MapError` line, never a traceback.

Then two passes. pydantic checks the structure (types, unknown keys, GDID text, empty
lists); then :func:`_semantic_problems` checks what relates one part of the file to another
(unknown servers, sorted starts, a server used twice in an area). Both passes report a path
such as ``areas.user.partitions[1].start``, which is mapped back to the YAML line, so every
error names the file, the line and the problem in one message.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mdb.dialects import find_sql_dialect, sql_dialect
from mdb.errors import MapError, RoutingError
from mdb.gdid import GDID
from mdb.urls import MONGO, kind_of_url, mask_secrets, mask_url, sqlalchemy_url

__all__ = [
    "AreaSpec",
    "EngineSpec",
    "PartitionMap",
    "PartitionSpec",
    "RangeSetSpec",
    "ServerSpec",
    "absolute_start",
    "MAX_ALIAS_NODES",
    "MAX_DEPTH",
    "MAX_MAP_BYTES",
    "MAX_PROBLEMS_LISTED",
    "load_map",
    "load_map_cached",
    "parse_map",
    "read_map_text",
    "safe_yaml_load",
    "sqlite_file",
]

Path_ = tuple[str | int, ...]
_MAX_SHARDING_VALUE = GDID(2**32 - 1, 0, 2**60 - 1).sharding_value  # era * 2^60 + counter


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSpec(_Strict):
    """Pool and connect settings of a server's engines; an unset field takes mdb's default.

    Why in the map: the connection budget (processes x servers x (pool_size + max_overflow))
    must fit every server's ``max_connections``, and a powered-off host must fail a command
    within ``connect_timeout`` seconds instead of the OS's minutes (docs/operations.md).
    """

    pool_size: int | None = Field(default=None, ge=1, strict=True)
    """Connections each process keeps open to the server (default 10)."""
    max_overflow: int | None = Field(default=None, ge=0, strict=True)
    """Extra connections a busy process may open beyond ``pool_size`` (default 20)."""
    pool_timeout: float | None = Field(default=None, gt=0)
    """Seconds to wait for a free pooled connection before failing (default 30)."""
    pool_recycle: float | None = Field(default=None, gt=0)
    """Replace a pooled connection older than this many seconds (default: never)."""
    connect_timeout: int | None = Field(default=None, ge=1, strict=True)
    """PostgreSQL: seconds to establish a connection (default 10; libpq counts at least 2)."""
    max_connections_per_instance: int | None = Field(default=None, ge=1, strict=True)
    """PostgreSQL: most connections one process holds open to the server's instance (host:port),
    over all its databases; the smallest value among the servers of an instance wins (default:
    no cap). Pools wait for a free one instead of exceeding it."""
    max_connections_total: int | None = Field(default=None, ge=1, strict=True)
    """PostgreSQL: most connections one process holds open over all instances; the smallest
    value among the map's servers wins (default: no cap)."""
    idle_timeout: float | None = Field(default=None, gt=0)
    """PostgreSQL: close a pooled connection idle for this many seconds (default 300)."""

    def over(self, defaults: EngineSpec | None) -> EngineSpec:
        """These settings, with the fields left unset here taken from ``defaults``."""
        if defaults is None:
            return self
        return defaults.model_copy(update={k: getattr(self, k) for k in self.model_fields_set})


class ServerSpec(_Strict):
    primary: str = Field(min_length=1)
    replica: str | None = None
    engine: EngineSpec | None = None
    """Pool and connect settings, over the map's ``engine_defaults`` (already merged in when loaded)."""
    pooler: Literal["none", "transaction"] = "none"
    """``transaction``: the URLs lead through a transaction-pooling pooler (PgBouncer
    ``pool_mode=transaction``), so mdb keeps no state in a server session (docs/operations.md)."""
    direct: str | None = None
    """A URL of the same database that bypasses the pooler, used only by the tools (moves,
    reshards, map apply, schema apply) so that they never wait for a pooled server connection
    while holding a lock that pooled sessions queue on."""

    def __repr_args__(self) -> Iterator[tuple[str, Any]]:
        yield "primary", mask_url(self.primary)
        if self.replica is not None:
            yield "replica", mask_url(self.replica)
        if self.engine is not None:
            yield "engine", self.engine
        if self.pooler != "none":
            yield "pooler", self.pooler
        if self.direct is not None:
            yield "direct", mask_url(self.direct)

    @property
    def masked_primary(self) -> str:
        return mask_url(self.primary)

    @property
    def masked_replica(self) -> str | None:
        return None if self.replica is None else mask_url(self.replica)


class PartitionSpec(_Strict):
    start: GDID
    shards: tuple[str, ...] = Field(min_length=1)


class RangeSetSpec(_Strict):
    breakpoint: GDID
    partitions: tuple[PartitionSpec, ...] = Field(min_length=1)

    def absolute_starts(self) -> tuple[int, ...]:
        """Each partition's start as a sharding value (see :func:`absolute_start`)."""
        return tuple(absolute_start(self.breakpoint, p.start) for p in self.partitions)


def absolute_start(breakpoint: GDID, offset: GDID) -> int:
    """A partition's start as a sharding value: its ``start`` is an offset from its range set's
    breakpoint (docs/partition-map.md). The one place this rule is written; the router, the
    validator, the diff and the inspectors ask it."""
    return breakpoint.sharding_value + offset.sharding_value


class AreaSpec(_Strict):
    kind: Literal["partitioned", "central"] = "partitioned"
    partitions: Annotated[tuple[PartitionSpec, ...], Field(min_length=1)] | None = None
    range_sets: Annotated[tuple[RangeSetSpec, ...], Field(min_length=1)] | None = None
    shards: tuple[str, ...] | None = None

    def effective_range_sets(self) -> tuple[RangeSetSpec, ...]:
        """The area's range sets; plain ``partitions`` are one set with breakpoint 0."""
        if self.range_sets is not None:
            return self.range_sets
        if self.partitions is not None:
            return (RangeSetSpec(breakpoint=GDID.ZERO, partitions=self.partitions),)
        return ()

    def servers(self) -> list[str]:
        """Every server the area uses, in map order."""
        if self.kind == "central":
            return list(self.shards or ())
        return [s for rs in self.effective_range_sets() for p in rs.partitions for s in p.shards]


class PartitionMap(_Strict):
    version: int = Field(ge=1, le=2**63 - 1, strict=True)
    """At most 2^63-1: the version is stored in a BIGINT (map history, layout stamps)."""
    servers: dict[str, ServerSpec]
    areas: dict[str, AreaSpec]
    models: tuple[str, ...] = ()
    """Python modules to import so their briefcase types register (used by the CLI)."""
    engine_defaults: EngineSpec | None = None
    """Engine settings of every server; a server's own ``engine:`` fields win over them."""

    source: str = Field(default="<map>", exclude=True)
    folder: str | None = Field(default=None, exclude=True)
    """The folder relative SQLite paths were resolved against (the map file's), None if none was."""

    @model_validator(mode="after")
    def _merge_engine_defaults(self) -> PartitionMap:
        """Give every server its effective engine settings, so the engines read one place."""
        if self.engine_defaults is not None:
            for name, spec in self.servers.items():
                engine = (spec.engine or EngineSpec()).over(self.engine_defaults)
                self.servers[name] = spec.model_copy(update={"engine": engine})
        return self

    def kind_of(self, server: str) -> str:
        """The kind of server ``server`` is (``mdb.urls.SQL``, ``MONGO``; by its primary URL)."""
        try:
            return kind_of_url(self.servers[server].primary)
        except KeyError:
            raise RoutingError(f"unknown server {server!r} (known: {', '.join(sorted(self.servers))})") from None

    def servers_of_kind(self, kind: str) -> list[str]:
        """The servers of ``kind``, in map order."""
        return [name for name, spec in self.servers.items() if kind_of_url(spec.primary) == kind]

    @property
    def central_area(self) -> str:
        return next(name for name, a in self.areas.items() if a.kind == "central")

    def to_yaml(self) -> str:
        """The map as YAML (with ``${NAME}`` already expanded: do not print it unmasked)."""
        data = self.model_dump(mode="json", exclude_none=True, exclude={"source"})
        if not data.get("models"):
            data.pop("models", None)
        for server in data["servers"].values():
            if server.get("pooler") == "none":
                del server["pooler"]  # the default: maps written before the field stay byte-identical
        for area in data["areas"].values():
            if area.get("kind") == "partitioned":
                del area["kind"]
        return yaml.safe_dump(data, sort_keys=False)

    def resolved_in(self, folder: str | os.PathLike[str] | None) -> PartitionMap:
        """This map with relative SQLite paths made absolute under ``folder``.

        A relative SQLite path in a map means "next to the map file", wherever mdb runs from
        (docs/partition-map.md): ``mdb where /srv/maps/m.yaml`` run from a home folder must
        open /srv/maps/mdb-data/..., not create an empty ./mdb-data/. A map that already has a
        folder, or ``folder`` None (a map given as text), is returned as it is.
        """
        if folder is None or self.folder is not None:
            return self
        base = Path(folder).resolve()
        servers = {name: _rebased_server(spec, base) for name, spec in self.servers.items()}
        return self.model_copy(update={"servers": servers, "folder": str(base)})


def sqlite_file(url: str) -> str | None:
    """The database file a SQLite URL names, as written; None for other backends, for an
    in-memory database, a ``file:`` URI, or a URL that does not parse (the loader refuses it)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    dialect = find_sql_dialect(parsed)
    return None if dialect is None else dialect.database_file(parsed)


def _rebased_url(url: str, base: Path) -> str:
    from sqlalchemy.engine import make_url

    database = sqlite_file(url)
    if database is None or Path(database).is_absolute():
        return url
    return make_url(url).set(database=str(base / database)).render_as_string(hide_password=False)


def _rebased_server(spec: ServerSpec, base: Path) -> ServerSpec:
    update = {"primary": _rebased_url(spec.primary, base)}
    if spec.replica is not None:
        update["replica"] = _rebased_url(spec.replica, base)
    return spec.model_copy(update=update)


# -- hostile-input limits ------------------------------------------------------------------------

MAX_MAP_BYTES = 8 * 1024 * 1024
"""A map of 10,000 partitions is ~0.6 MB; anything past this is not a map."""
MAX_DEPTH = 64
"""A map nests about 9 levels (areas.user.range_sets[0].partitions[0].shards[0])."""
MAX_ALIAS_NODES = 10_000
"""Nodes that aliases may add in all: reuse of a shard list is fine, a billion laughs is not."""
MAX_PROBLEMS_LISTED = 10
"""Problems one error message lists before "... and N more" (one line must stay readable)."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with nesting and alias-expansion bounds enforced while composing.

    Composing builds a node graph in which an alias is one shared node; the cost explodes only
    when something walks the graph as a tree. So this loader keeps each node's expanded size
    and refuses, at the alias that crosses :data:`MAX_ALIAS_NODES`, before anything walks it.
    An alias to a node still being composed (a recursive structure) is refused too. The depth
    bound keeps the recursive composer (and our own walk) far from Python's recursion limit.
    """

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self._source = source
        self._depth = 0
        self._alias_nodes = 0
        self._sizes: dict[int, int] = {}

    def _refuse(self, line: int, problem: str) -> MapError:
        return MapError(f"{self._source}:{line}: {problem}")

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None:
                size = self._sizes.get(id(target))
                if size is None:
                    raise self._refuse(line, f"alias *{event.anchor} refers to a node that contains it (recursive YAML)")
                self._alias_nodes += size
                if self._alias_nodes > MAX_ALIAS_NODES:
                    raise self._refuse(line, f"YAML aliases expand to more than {MAX_ALIAS_NODES} nodes; write the map out instead")
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise self._refuse(line, f"the YAML nests deeper than {MAX_DEPTH} levels")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if node is not None:
            self._sizes[id(node)] = 1 + sum(self._sizes.get(id(child), 1) for child in _children(node))
        return node


def _children(node: yaml.Node) -> Iterator[Any]:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield key
            yield value
    elif isinstance(node, yaml.SequenceNode):
        yield from node.value


def _yaml_error(exc: yaml.YAMLError, source: str) -> MapError:
    mark = getattr(exc, "problem_mark", None)
    where = f"{source}:{mark.line + 1}" if mark is not None else source
    problem = getattr(exc, "problem", None) or str(exc)
    # The parser notices a missing bracket or quote only at the next token, often a line
    # later; the construct it was reading when it failed points at the real culprit.
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None and (mark is None or context_mark.line != mark.line):
        problem += f" ({context} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    return MapError(f"{where}: invalid YAML: {' '.join(str(problem).split())}")


def _compose(text: str, source: str) -> yaml.Node | None:
    try:
        loader = _BoundedLoader(text, source)  # the reader refuses control characters right here
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source) from None
    try:
        return loader.get_single_node()
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source) from None
    finally:
        loader.dispose()


def safe_yaml_load(text: str, source: str = "<map>") -> Any:
    """Plain data from YAML text under the same bounds as maps (for map texts read back)."""
    node = _compose(text, source)
    if node is None:
        return None
    problems: list[tuple[Path_, str]] = []
    data = _construct(yaml.SafeLoader(""), node, (), {}, problems, expand_env=False)
    if problems:
        raise MapError(_format(source, problems, {}))
    return data


def read_map_text(path: str | os.PathLike[str]) -> str:
    """A map file's text: at most :data:`MAX_MAP_BYTES`, strict UTF-8; errors name file and byte."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_MAP_BYTES + 1)
    except OSError as exc:
        raise MapError(f"{p}: cannot read the map: {exc.strerror or exc}") from None
    if len(data) > MAX_MAP_BYTES:
        raise MapError(f"{p}: the map is larger than {MAX_MAP_BYTES // (1024 * 1024)} MiB; that is not a partition map")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise MapError(
            f"{p}:{line}: the map is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
            "cannot be decoded (save the file as UTF-8)"
        ) from None


# -- loading -------------------------------------------------------------------------------------

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class _Located:
    data: Any
    lines: dict[Path_, int]


def _construct(
    loader: yaml.SafeLoader,
    node: yaml.Node,
    path: Path_,
    lines: dict[Path_, int],
    problems: list[tuple[Path_, str]],
    *,
    expand_env: bool = True,
) -> Any:
    """Build plain Python data from a YAML node, recording the line of every path."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            if key in out:
                problems.append((path + (key,), f"duplicate key {key!r}"))
            out[key] = _construct(loader, value_node, path + (key,), lines, problems, expand_env=expand_env)
            lines[path + (key,)] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(loader, item, path + (i,), lines, problems, expand_env=expand_env) for i, item in enumerate(node.value)]
    if node.tag == "tag:yaml.org,2002:int" and ":" in str(node.value):
        # YAML 1.1 reads an unquoted 1:0:5 as a base-60 integer; keep the text so a GDID
        # written without quotes still parses as the GDID it looks like.
        value: Any = str(node.value)
    else:
        try:
            value = loader.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError) as exc:  # an unknown tag, an integer of 5,000 digits
            problems.append((path, f"cannot read this value: {' '.join(str(getattr(exc, 'problem', None) or exc).split())}"))
            return None
    if isinstance(value, str) and expand_env:

        def expand(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in os.environ:
                problems.append((path, f"environment variable {name} is not set"))
                return match.group(0)
            return os.environ[name]

        value = _ENV_REF.sub(expand, value)
    return value


def _locate(text: str, source: str) -> tuple[_Located, list[tuple[Path_, str]]]:
    node = _compose(text, source)
    if node is None:
        raise MapError(f"{source}: the map is empty")
    lines: dict[Path_, int] = {}
    problems: list[tuple[Path_, str]] = []
    data = _construct(yaml.SafeLoader(""), node, (), lines, problems)
    return _Located(data, lines), _merged_env_problems(problems, lines)


def _merged_env_problems(problems: list[tuple[Path_, str]], lines: Mapping[Path_, int]) -> list[tuple[Path_, str]]:
    """One problem per missing environment variable, naming every line that uses it.

    A password variable is typically used by every server URL: five identical problems on
    one line say less than one that lists the lines.
    """
    out: list[tuple[Path_, str]] = []
    uses: dict[str, list[Path_]] = {}
    for path, message in problems:
        m = re.fullmatch(r"environment variable (\S+) is not set", message)
        if m is None:
            out.append((path, message))
            continue
        if m.group(1) not in uses:
            out.append((path, message))
        uses.setdefault(m.group(1), []).append(path)
    for i, (path, message) in enumerate(out):
        m = re.fullmatch(r"environment variable (\S+) is not set", message)
        if m is not None and len(uses[m.group(1)]) > 1:
            others = sorted({str(_line_of(p, lines)) for p in uses[m.group(1)][1:]} - {str(_line_of(path, lines))}, key=int)
            also = f" (also used on line{'s' if len(others) > 1 else ''} {', '.join(others)})" if others else ""
            out[i] = (path, f"{message}{also}")
    return out


def _dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top>"


def _line_of(path: Path_, lines: Mapping[Path_, int]) -> int | None:
    for cut in range(len(path), -1, -1):
        if path[:cut] in lines:
            return lines[path[:cut]]
    return None


def _format(source: str, problems: Sequence[tuple[Path_, str]], lines: Mapping[Path_, int]) -> str:
    parts = []
    for path, message in problems[:MAX_PROBLEMS_LISTED]:
        line = _line_of(path, lines)
        where = f"{source}:{line}" if line is not None else source
        parts.append(f"{where}: {_dotted(path)}: {message}")
    if len(problems) > MAX_PROBLEMS_LISTED:
        parts.append(f"... and {len(problems) - MAX_PROBLEMS_LISTED} more")
    return "; ".join(parts)


def _pydantic_problems(exc: ValidationError) -> list[tuple[Path_, str]]:
    problems: list[tuple[Path_, str]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            problems.append((loc, f"unknown key {loc[-1]!r}"))
        elif err["type"] == "missing":
            problems.append((loc, "required key is missing"))
        elif err["type"] == "too_short" and loc and loc[-1] in ("shards", "partitions", "range_sets"):
            if isinstance(err.get("input"), (list, tuple)) and err["input"]:
                continue  # not empty: its items failed, and their own errors say why
            problems.append((loc, f"the {loc[-1]} list is empty"))
        else:
            msg = err["msg"]
            ctx_error = err.get("ctx", {}).get("error")
            if ctx_error is not None:
                msg = str(ctx_error)
            problems.append((loc, msg))
    return problems


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,62}$")


def _is_postgres_url(url: str) -> bool:
    return url.split(":", 1)[0].split("+", 1)[0].lower() in ("postgresql", "postgres")


def _pooler_problems(name: str, spec: ServerSpec) -> list[tuple[Path_, str]]:
    """``pooler:`` and ``direct:`` only mean something for PostgreSQL servers (a pooler in front of
    SQLite or MongoDB does not exist), and ``direct:`` only beside a pooler: it is the way around one."""
    where: Path_ = ("servers", name)
    problems: list[tuple[Path_, str]] = []
    if spec.pooler != "none" and not _is_postgres_url(spec.primary):
        problems.append((where + ("pooler",), f"pooler: {spec.pooler} needs a PostgreSQL primary URL (server {name!r} is not one)"))
    if spec.direct is not None:
        if spec.pooler == "none":
            problems.append((where + ("direct",), f"direct: is the way around a pooler; server {name!r} has none (set pooler: transaction, or drop direct:)"))
        if not _is_postgres_url(spec.direct):
            problems.append((where + ("direct",), f"direct: of server {name!r} must be a PostgreSQL URL"))
    return problems


_SUPPORTED_DRIVERS = {"sqlite": ("pysqlite",), "postgresql": ("psycopg",)}
"""backend -> drivers mdb runs on: its BEGIN prelude needs psycopg 3 or sqlite3 (mdb.engines)."""
_URL_EXAMPLES = "postgresql+psycopg://user@host/db, sqlite:///file.db or mongodb://host/db"


def _url_problem(url: str) -> str | None:
    """Why mdb cannot connect with ``url``, or None; loads the dialect and its driver module.

    Caught here, a bad URL is one line naming the server and the map line; caught at connect
    time it was a 65-line traceback from every command.
    """
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    shown = mask_url(url)
    if kind_of_url(url) == MONGO:
        return _mongo_url_problem(url, shown)
    try:
        parsed = sqlalchemy_url(url)
    except (ArgumentError, ValueError):
        return f"{shown!r} is not a database URL (write e.g. {_URL_EXAMPLES})"
    backend = parsed.get_backend_name()
    if backend not in _SUPPORTED_DRIVERS:
        return f"{shown}: mdb does not support {backend!r} servers (write e.g. {_URL_EXAMPLES})"
    problem = sql_dialect(backend).url_problem(parsed)
    if problem is not None:
        return f"{shown}: {problem}"
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError as exc:
        return f"{shown}: cannot load the {parsed.drivername!r} dialect: {exc}"
    if dialect.driver not in _SUPPORTED_DRIVERS[backend]:
        wanted = ", ".join(f"{backend}+{d}" for d in _SUPPORTED_DRIVERS[backend])
        return f"{shown}: mdb does not support the {dialect.driver!r} driver (use {wanted})"
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        return f"{shown}: cannot load the {dialect.driver!r} driver: {exc}"
    return None


def _mongo_url_problem(url: str, shown: str) -> str | None:
    try:
        from pymongo import uri_parser
    except ImportError:
        return f"{shown}: a MongoDB server needs pymongo, which is not installed"
    if url.startswith("mongodb+srv://"):
        return None  # parsing an SRV URL resolves DNS: too slow and too flaky for a file check
    try:
        uri_parser.parse_uri(url)
    except Exception as exc:  # pymongo raises InvalidURI, ConfigurationError or ValueError; all mean "bad URL"
        return f"{shown}: not a valid MongoDB URL: {mask_secrets(str(exc))}"
    return None


def _url_problems(m: PartitionMap) -> list[tuple[Path_, str]]:
    problems: list[tuple[Path_, str]] = []
    checked: dict[str, str | None] = {}
    for name, spec in m.servers.items():
        for key in ("primary", "replica", "direct"):
            url = getattr(spec, key)
            if url is None:
                continue
            if url not in checked:
                checked[url] = _url_problem(url)
            problem = checked[url]
            if problem is not None:
                problems.append((("servers", name, key), f"server {name!r}: {problem}"))
    return problems


def _semantic_problems(m: PartitionMap) -> list[tuple[Path_, str]]:
    problems: list[tuple[Path_, str]] = _url_problems(m)
    # Names end up in SQL literals, lock keys and file names: keep them to a safe alphabet.
    for kind, names in (("server", m.servers), ("area", m.areas)):
        for name in names:
            if not _NAME.match(name):
                problems.append(((f"{kind}s", name), f"{kind} name {name!r} must start with a letter or _ and use only letters, digits, _ . - (at most 63)"))
    for name, spec in m.servers.items():
        problems.extend(_pooler_problems(name, spec))
    central = [name for name, a in m.areas.items() if a.kind == "central"]
    if not central:
        problems.append((("areas",), "the map needs exactly one area with kind: central, found none"))
    elif len(central) > 1:
        problems.append((("areas",), f"the map needs exactly one central area, found {len(central)}: {', '.join(central)}"))

    for area_name, area in m.areas.items():
        base: Path_ = ("areas", area_name)
        seen: dict[str, Path_] = {}

        def check_server(server: str, where: Path_) -> None:
            if server not in m.servers:
                problems.append((where, f"unknown server {server!r} (not under servers:)"))
            if server in seen:
                problems.append((where, f"server {server!r} is used twice in area {area_name!r} (first at {_dotted(seen[server])})"))
            else:
                seen[server] = where

        if area.kind == "central":
            if area.partitions is not None or area.range_sets is not None:
                problems.append((base, "a central area has shards:, not partitions or range_sets"))
            if not area.shards:
                problems.append((base + ("shards",), "a central area needs a non-empty shards: list"))
            for i, server in enumerate(area.shards or ()):
                check_server(server, base + ("shards", i))
            continue

        if area.shards is not None:
            problems.append((base + ("shards",), "shards: belongs to a central area; a partitioned area has partitions"))
        if (area.partitions is None) == (area.range_sets is None):
            problems.append((base, "a partitioned area needs exactly one of partitions: or range_sets:"))
            continue

        range_sets = area.effective_range_sets()
        explicit_sets = area.range_sets is not None
        for r, rs in enumerate(range_sets):
            rs_path: Path_ = base + ("range_sets", r) if explicit_sets else base
            if rs.breakpoint.authority != 0:
                problems.append((rs_path + ("breakpoint",), f"breakpoint {rs.breakpoint} must have authority 0"))
            if r > 0 and rs.breakpoint.sharding_value <= range_sets[r - 1].breakpoint.sharding_value:
                problems.append((rs_path + ("breakpoint",), f"breakpoint {rs.breakpoint} must be above the previous breakpoint {range_sets[r - 1].breakpoint}"))
            limit = range_sets[r + 1].breakpoint.sharding_value if r + 1 < len(range_sets) else None
            for p, part in enumerate(rs.partitions):
                p_path = rs_path + ("partitions", p)
                if part.start.authority != 0:
                    problems.append((p_path + ("start",), f"partition start {part.start} must have authority 0 (authority never influences placement)"))
                if p > 0 and part.start.sharding_value <= rs.partitions[p - 1].start.sharding_value:
                    kind = "duplicate" if part.start.sharding_value == rs.partitions[p - 1].start.sharding_value else "unsorted"
                    problems.append((p_path + ("start",), f"{kind} partition start {part.start}: starts must strictly increase (previous is {rs.partitions[p - 1].start})"))
                if r > 0 and p == 0 and part.start.sharding_value != 0:
                    problems.append((p_path + ("start",), f"the first partition of range set {rs.breakpoint} must start at offset 0:0:0, or the GDIDs from the breakpoint up to {part.start} past it could not be routed"))
                absolute = absolute_start(rs.breakpoint, part.start)
                if absolute > _MAX_SHARDING_VALUE:
                    problems.append((p_path + ("start",), f"partition start {part.start} (offset from breakpoint {rs.breakpoint}) lies past the largest GDID"))
                if limit is not None and absolute >= limit:
                    problems.append((p_path + ("start",), f"partition start {part.start} (offset from breakpoint {rs.breakpoint}) lies at or past the next breakpoint, so no GDID could reach it"))
                for s, server in enumerate(part.shards):
                    check_server(server, p_path + ("shards", s))
    return problems


_INTERNAL_FIELDS = ("source", "folder")


def parse_map(text: str, source: str = "<map>", *, folder: str | os.PathLike[str] | None = None) -> PartitionMap:
    """Parse and validate map text; ``source`` names the file in error messages.

    ``folder`` is where relative SQLite paths point (the map file's folder); without it they
    stay relative, i.e. to the current folder (:meth:`PartitionMap.resolved_in`).
    """
    if len(text) > MAX_MAP_BYTES:
        raise MapError(f"{source}: the map is larger than {MAX_MAP_BYTES // (1024 * 1024)} MiB; that is not a partition map")
    located, problems = _locate(text, source)
    if problems:
        raise MapError(_format(source, problems, located.lines))
    if not isinstance(located.data, dict):
        raise MapError(f"{source}:1: the map must be a mapping with version, servers and areas")
    internal = [key for key in _INTERNAL_FIELDS if key in located.data]  # fields, not keys of the format
    if internal:
        raise MapError(_format(source, [((key,), f"unknown key {key!r}") for key in internal], located.lines))
    try:
        m = PartitionMap.model_validate({**located.data, "source": source})
    except ValidationError as exc:
        raise MapError(_format(source, _pydantic_problems(exc), located.lines)) from None
    problems = _semantic_problems(m)
    if problems:
        raise MapError(_format(source, problems, located.lines))
    return m.resolved_in(folder)


def load_map(path: str | os.PathLike[str]) -> PartitionMap:
    """Load and validate a partition map file, expanding ``${NAME}`` from the environment.

    Relative SQLite paths resolve against the file's folder, not the current one.
    """
    p = Path(path)
    return parse_map(read_map_text(p), str(p), folder=p.parent)


_parsed_lock = threading.Lock()
_parsed: dict[tuple[str, str], tuple[tuple[bytes, tuple[str | None, ...]], PartitionMap]] = {}
"""Per map file (path as given, resolved path): the fingerprint of what was parsed, and the map it gave."""


def _fingerprint(text: str) -> tuple[bytes, tuple[str | None, ...]]:
    """What a parse depends on: the file's text and the environment variables it names."""
    names = sorted(set(_ENV_REF.findall(text)))
    return hashlib.sha256(text.encode("utf-8")).digest(), tuple(os.environ.get(n) for n in names)


def load_map_cached(path: str | os.PathLike[str]) -> PartitionMap:
    """:func:`load_map`, but a file whose text (and ``${NAME}`` values) did not change is not parsed again.

    A Store re-reads its map file on every refresh, and a refresh follows every stale route:
    validating the YAML each time cost more than the route itself. Reading and
    hashing the file is cheap; the parse is not. Keyed by content rather than mtime, so a
    file rewritten within one mtime tick is still seen. The map is frozen, so sharing it is safe;
    a file that fails to parse is not cached (each load reports its error).
    """
    p = Path(path)
    text = read_map_text(p)
    key = (str(p), str(p.resolve()))  # as given too: it names the file in errors and anchors SQLite paths
    fingerprint = _fingerprint(text)
    with _parsed_lock:
        hit = _parsed.get(key)
    if hit is not None and hit[0] == fingerprint:
        return hit[1]
    pmap = parse_map(text, str(p), folder=p.parent)
    with _parsed_lock:
        _parsed[key] = (fingerprint, pmap)
    return pmap
