"""The partition map: versioned YAML describing servers, areas, partitions and range sets.

Loading is two passes. pydantic checks the structure (types, unknown keys, GDID text, empty
lists); then :func:`_semantic_problems` checks what relates one part of the file to another
(unknown servers, sorted starts, a server used twice in an area). Both passes report a path
such as ``areas.user.partitions[1].start``, which is mapped back to the YAML line, so every
error names the file, the line and the problem in one message.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mdb.errors import MapError
from mdb.gdid import GDID
from mdb.urls import mask_url

__all__ = [
    "AreaSpec",
    "PartitionMap",
    "PartitionSpec",
    "RangeSetSpec",
    "ServerSpec",
    "load_map",
    "parse_map",
]

Path_ = tuple[str | int, ...]
_MAX_SHARDING_VALUE = GDID(2**32 - 1, 0, 2**60 - 1).sharding_value  # era * 2^60 + counter


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSpec(_Strict):
    primary: str = Field(min_length=1)
    replica: str | None = None
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
    version: int = Field(ge=1, strict=True)
    servers: dict[str, ServerSpec]
    areas: dict[str, AreaSpec]
    models: tuple[str, ...] = ()
    """Python modules to import so their briefcase types register (used by the CLI)."""

    source: str = Field(default="<map>", exclude=True)

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
) -> Any:
    """Build plain Python data from a YAML node, recording the line of every path."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            if key in out:
                problems.append((path + (key,), f"duplicate key {key!r}"))
            out[key] = _construct(loader, value_node, path + (key,), lines, problems)
            lines[path + (key,)] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(loader, item, path + (i,), lines, problems) for i, item in enumerate(node.value)]
    if node.tag == "tag:yaml.org,2002:int" and ":" in str(node.value):
        # YAML 1.1 reads an unquoted 1:0:5 as a base-60 integer; keep the text so a GDID
        # written without quotes still parses as the GDID it looks like.
        value: Any = str(node.value)
    else:
        value = loader.construct_object(node, deep=True)
    if isinstance(value, str):

        def expand(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in os.environ:
                problems.append((path, f"environment variable {name} is not set"))
                return match.group(0)
            return os.environ[name]

        value = _ENV_REF.sub(expand, value)
    return value


def _locate(text: str, source: str) -> tuple[_Located, list[tuple[Path_, str]]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        # The parser notices a missing bracket or quote only at the next token, often a line
        # later; the construct it was reading when it failed points at the real culprit.
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and context_mark is not None and (mark is None or context_mark.line != mark.line):
            problem += f" ({context} at line {context_mark.line + 1}, column {context_mark.column + 1})"
        raise MapError(f"{where}: invalid YAML: {problem}") from None
    if node is None:
        raise MapError(f"{source}: the map is empty")
    lines: dict[Path_, int] = {}
    problems: list[tuple[Path_, str]] = []
    data = _construct(yaml.SafeLoader(""), node, (), lines, problems)
    return _Located(data, lines), problems


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


def _format(source: str, problems: list[tuple[Path_, str]], lines: Mapping[Path_, int]) -> str:
    parts = []
    for path, message in problems:
        line = _line_of(path, lines)
        where = f"{source}:{line}" if line is not None else source
        parts.append(f"{where}: {_dotted(path)}: {message}")
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


def _semantic_problems(m: PartitionMap) -> list[tuple[Path_, str]]:
    problems: list[tuple[Path_, str]] = []
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
                absolute = rs.breakpoint.sharding_value + part.start.sharding_value
                if absolute > _MAX_SHARDING_VALUE:
                    problems.append((p_path + ("start",), f"partition start {part.start} (offset from breakpoint {rs.breakpoint}) lies past the largest GDID"))
                if limit is not None and absolute >= limit:
                    problems.append((p_path + ("start",), f"partition start {part.start} (offset from breakpoint {rs.breakpoint}) lies at or past the next breakpoint, so no GDID could reach it"))
                for s, server in enumerate(part.shards):
                    check_server(server, p_path + ("shards", s))
    return problems


def parse_map(text: str, source: str = "<map>") -> PartitionMap:
    """Parse and validate map text; ``source`` names the file in error messages."""
    located, problems = _locate(text, source)
    if problems:
        raise MapError(_format(source, problems, located.lines))
    if not isinstance(located.data, dict):
        raise MapError(f"{source}:1: the map must be a mapping with version, servers and areas")
    if "source" in located.data:  # an internal field, not a key of the file format
        raise MapError(_format(source, [(("source",), "unknown key 'source'")], located.lines))
    try:
        m = PartitionMap.model_validate({**located.data, "source": source})
    except ValidationError as exc:
        raise MapError(_format(source, _pydantic_problems(exc), located.lines)) from None
    problems = _semantic_problems(m)
    if problems:
        raise MapError(_format(source, problems, located.lines))
    return m


def load_map(path: str | os.PathLike[str]) -> PartitionMap:
    """Load and validate a partition map file, expanding ``${NAME}`` from the environment."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise MapError(f"{p}: cannot read the map: {exc.strerror or exc}") from None
    return parse_map(text, str(p))
