"""Write a partition map YAML for tests from server URLs (shared by many test modules).

    path = write_map(tmp_path, {"c": url0, "u1": url1, "u2": url2}, central=["c"],
                     partitions=[("0:0:0", ["u1", "u2"])])
    store = Store.from_yaml(path, types=[UserBriefcase])

Writing the same ``directory``/``filename`` again with a higher ``version`` replaces the file,
which is how a test publishes a new map version to a Store that holds the path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = ["map_dict", "write_map"]

PartitionList = Sequence[tuple[str, Sequence[str]]]


def map_dict(
    servers: Mapping[str, str],
    *,
    central: Sequence[str],
    partitions: PartitionList = (),
    area: str = "user",
    replicas: Mapping[str, str] | None = None,
    version: int = 1,
    extra_areas: Mapping[str, PartitionList] | None = None,
) -> dict[str, Any]:
    """The map as plain data: ``partitions`` are (start GDID text, shard server names)."""
    replicas = replicas or {}
    unknown = set(replicas) - set(servers)
    if unknown:
        raise ValueError(f"replica URLs for servers not in the map: {sorted(unknown)}")
    server_specs: dict[str, dict[str, str]] = {}
    for name, url in servers.items():
        spec = {"primary": url}
        if name in replicas:
            spec["replica"] = replicas[name]
        server_specs[name] = spec
    areas: dict[str, Any] = {"central": {"kind": "central", "shards": list(central)}}
    for name, parts in {area: partitions, **(extra_areas or {})}.items():
        if parts:
            areas[name] = {"partitions": [{"start": start, "shards": list(shards)} for start, shards in parts]}
    return {"version": version, "servers": server_specs, "areas": areas}


def write_map(
    directory: str | Path,
    servers: Mapping[str, str],
    *,
    central: Sequence[str],
    partitions: PartitionList = (),
    area: str = "user",
    replicas: Mapping[str, str] | None = None,
    version: int = 1,
    extra_areas: Mapping[str, PartitionList] | None = None,
    filename: str = "map.yaml",
) -> Path:
    """Write the map YAML into ``directory`` and return its path (see :func:`map_dict`)."""
    data = map_dict(
        servers, central=central, partitions=partitions, area=area, replicas=replicas, version=version,
        extra_areas=extra_areas,
    )
    path = Path(directory) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    tmp.replace(path)  # atomic: a Store refreshing concurrently never reads half a file
    return path
