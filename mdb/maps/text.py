"""Map text: the secret-safe YAML recorded in CENTRAL, and the one place a map file is written.

Two kinds of text leave a process: the map recorded in the history (``mdb_maps``, read by
every process and printed by ``mdb map pull``), which must never carry a literal password,
and the map file itself, rewritten by a reshard and by ``mdb map pull -o``. The file is
re-read by every Store on refresh, so it is replaced atomically (never half written), and a
reshard keeps the file as it was beside it, because YAML written as data loses comments and
layout.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from mdb.errors import MapEditError, RoutingError
from mdb.gdid import GDID
from mdb.partition_map import PartitionMap, absolute_start, parse_map, safe_yaml_load
from mdb.urls import mask_url

__all__ = ["backup_map_file", "literal_secrets", "new_map_text", "recordable_yaml", "rewrite_map_file", "write_map_file"]

log = logging.getLogger("mdb.maps.text")

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SECRET_QUERY_KEYS = ("password", "passwd", "pwd", "secret", "token")


# -- secret-safe text ----------------------------------------------------------------------------


def _literal_secret(url: str) -> bool:
    """True if ``url`` carries a password that is not just a ``${NAME}`` reference."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return mask_url(url) != url
    values: list[str] = [parsed.password] if parsed.password else []
    for key, value in parsed.query.items():
        if key.lower() in _SECRET_QUERY_KEYS:
            values.extend(value if isinstance(value, tuple) else [value])
    return any(not _ENV_REF.fullmatch(str(v)) for v in values)


def _expand(text: str) -> str:
    return _ENV_REF.sub(lambda m: os.environ.get(m.group(1), m.group(0)), text)


def _raw_urls(texts: Iterable[str]) -> dict[str, str]:
    """expanded URL -> URL as written (with ``${NAME}``), from the server lists of map texts."""
    out: dict[str, str] = {}
    for text in texts:
        data = safe_yaml_load(text)
        servers = data.get("servers") if isinstance(data, dict) else None
        for spec in (servers or {}).values():
            for key in ("primary", "replica", "direct"):
                raw = spec.get(key) if isinstance(spec, dict) else None
                if isinstance(raw, str):
                    out.setdefault(_expand(raw), raw)
    return out


def recordable_yaml(pmap: PartitionMap, yaml_text: str | None, known_texts: Iterable[str] = ()) -> str:
    """The text to record for ``pmap``: never one that carries a literal password.

    With ``yaml_text`` (the file as written) it is checked and used. Without it, the map is
    dumped and each URL replaced by its unexpanded form from ``known_texts`` (the maps the
    system already knows); a URL with a password that no known text spells as ``${NAME}``
    is refused.
    """
    if yaml_text is not None:
        check = parse_map(yaml_text, "the map text to record", folder=pmap.folder)
        if check.model_dump() != pmap.model_dump():
            raise MapEditError("the YAML text given to record is not the map being applied")
        data = safe_yaml_load(yaml_text)
    else:
        data = yaml.safe_load(pmap.to_yaml())
        raw = _raw_urls(known_texts)
        for spec in data["servers"].values():
            for key in ("primary", "replica", "direct"):
                if key in spec and spec[key] in raw:
                    spec[key] = raw[spec[key]]
        yaml_text = yaml.safe_dump(data, sort_keys=False)
    problems = literal_secrets(data)
    if problems:
        raise MapEditError(problems[0])
    return yaml_text


def literal_secrets(data: object) -> list[str]:
    """One line per URL of map data (the YAML as written, ``${NAME}`` not expanded) that carries a
    literal password: the one rule ``map apply`` refuses by and ``map check`` reports by."""
    servers = data.get("servers") if isinstance(data, dict) else None
    problems = []
    for name, spec in (servers if isinstance(servers, dict) else {}).items():
        for key in ("primary", "replica", "direct"):
            url = spec.get(key) if isinstance(spec, dict) else None
            if isinstance(url, str) and _literal_secret(url):
                problems.append(
                    f"server {name!r} {key} URL {mask_url(url)} carries a literal password; the applied map is "
                    "stored in CENTRAL, so write it as ${NAME} (expanded from the environment)"
                )
    return problems


def new_map_text(current_text: str, area: str, start: GDID, new_shards: list[str], version: int) -> str:
    """The map file text with the partition's new shard list and a new version (a reshard's map).

    Edited as plain YAML data without expanding ``${NAME}``, so no secret lands in the text.
    """
    data = yaml.safe_load(current_text)
    spec = data.get("areas", {}).get(area)
    if spec is None:
        raise RoutingError(f"the map has no area {area!r}")
    sets = spec.get("range_sets") or [{"breakpoint": "0:0:0", "partitions": spec.get("partitions", [])}]
    for rs in sets:
        breakpoint = GDID.parse(str(rs["breakpoint"]))
        for part in rs["partitions"]:
            if absolute_start(breakpoint, GDID.parse(str(part["start"]))) == start.sharding_value:
                part["shards"] = list(new_shards)
                data["version"] = version
                return yaml.safe_dump(data, sort_keys=False)
    raise RoutingError(f"area {area!r} has no partition starting at {start}")


# -- the map file --------------------------------------------------------------------------------


def write_map_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a Store re-reading the file never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def backup_map_file(path: Path, text: str, version: int, tag: str) -> Path:
    """Keep the map file as it was (comments, layout) beside it before it is rewritten.

    The new version is written as YAML data, which keeps ``${NAME}`` references but not
    comments or layout; the copy lets the operator carry them over. Named after the old
    version and ``tag`` (the reshard's id), so a resumed reshard or a later one never
    overwrites it: ``<stem>.v<version>.before-<tag><suffix>``.
    """
    backup = path.with_name(f"{path.stem}.v{version}.before-{tag}{path.suffix}")
    if not backup.exists():
        write_map_file(backup, text)
    log.warning("map file %s rewritten for map version %d without its comments; the previous file is kept at %s", path, version + 1, backup)
    return backup


def rewrite_map_file(path: Path, text: str, version: int, *, tag: str, on_backup: Callable[[Path], None]) -> None:
    """Write map ``text`` (of map ``version``) to ``path``, unless the file holds that version or a newer one.

    An existing file is first copied by :func:`backup_map_file`, and ``on_backup`` is told
    where before the file is replaced (a reshard journals it, so a crash right after the
    rewrite still reports the copy). Idempotent: run again, it finds the version written.
    """
    old_text = path.read_text(encoding="utf-8") if path.is_file() else None
    current = None if old_text is None else parse_map(old_text, str(path))
    if current is not None and current.version >= version:
        return
    if old_text is not None:
        on_backup(backup_map_file(path, old_text, current.version if current else 0, tag))
    write_map_file(path, text)
