"""Shared by test_schema_apply and the suites beside it (moved out of test_schema_apply, which used to be imported by other test modules)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
import yaml
from support.mapfiles import map_dict


def write_models_map(tmp_path: Path, servers: dict[str, str], **kwargs: Any) -> Path:
    """A map (via tests/support/mapfiles.map_dict) that lists the demo models module under ``models:``."""
    data = map_dict(servers, **kwargs)
    data["models"] = ["mdb.demo.models"]
    path = tmp_path / "map.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path
