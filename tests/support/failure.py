"""Shared by test_shard_failure and the suites beside it (moved out of test_shard_failure, which used to be imported by other test modules)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from mdb.cli import app
from typer.testing import CliRunner

SECRET = "Sw0rdfish-shard-down-41"
runner = CliRunner()


def with_password(url: str) -> str:
    return url.replace("postgresql+psycopg://postgres@", f"postgresql+psycopg://postgres:{SECRET}@", 1)


def schema_apply(path: Path, *extra: str) -> Any:
    result = runner.invoke(app, ["schema", "apply", str(path), "--models", "mdb.demo.models", *extra],
                           env={"COLUMNS": "250"})
    assert SECRET not in result.stdout and SECRET not in result.stderr
    return result


