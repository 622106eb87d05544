"""``mdb migrate`` as an operator types it, on SQLite files: what it prints when a server or a file is bad.

A server that was skipped, failed or could not be read prints its revision as ``unknown`` (it
printed ``base``, which is a revision: "never migrated"); a revision file with a syntax error
is one line naming the file and the line (it was a traceback).
"""

from __future__ import annotations

import pytest
from pathlib import Path

import yaml
from support.mapfiles import map_dict
from support.moves import run_cli

from mdb.migrations.scripts import open_history

REV1 = '''"""a table of the history's own"""
from alembic import op
import sqlalchemy as sa

revision = "a1"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("mig_extra", sa.Column("id", sa.Integer(), primary_key=True))


def downgrade() -> None:
    op.drop_table("mig_extra")
'''


def _fleet(tmp_path: Path) -> tuple[Path, Path]:
    """A map (CENTRAL c, user shards u1 u2) with its schema applied and a one-revision history of area user."""
    urls = {name: f"sqlite:///{tmp_path / name}.db" for name in ("c", "u1", "u2")}
    data = map_dict(urls, central=["c"], partitions=[("0:0:0", ["u1", "u2"])])
    data["models"] = ["mdb.demo.models"]
    map_path = tmp_path / "map.yaml"
    map_path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    applied = run_cli(["schema", "apply", str(map_path)])
    assert applied.returncode == 0, (applied.stdout, applied.stderr)
    root = tmp_path / "migrations"
    open_history(root, "user", create=True)
    (root / "user" / "versions" / "a1_extra.py").write_text(REV1, encoding="utf-8")
    return map_path, root


def _row(out: str, server: str) -> list[str]:
    """The cells of ``server``'s row in the table ``mdb migrate`` printed."""
    rows = [line for line in out.splitlines() if line.startswith("│ user │") and f" {server} " in line]
    assert len(rows) == 1, out
    return [cell.strip() for cell in rows[0].split("│")[1:-1]]


@pytest.mark.slow  # 107 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_server_that_could_not_be_read_or_was_not_started_prints_unknown_not_base(tmp_path: Path) -> None:
    map_path, _root = _fleet(tmp_path)
    (tmp_path / "u2.db").write_bytes(b"this is not a database file" * 100)  # u2 cannot be read
    env = {"COLUMNS": "250"}

    status = run_cli(["migrate", "status", str(map_path)], env=env)
    assert status.returncode == 1, (status.stdout, status.stderr)
    assert _row(status.stdout, "u2")[3] == "unknown"  # area, server, roles, revision, ...
    assert _row(status.stdout, "u1")[3] == "base"  # read: never migrated

    up = run_cli(["migrate", "up", str(map_path), "--canary", "u2"], env=env)
    assert up.returncode == 1, (up.stdout, up.stderr)
    # area, server, before, after, outcome, detail
    assert _row(up.stdout, "u2")[2:5] == ["unknown", "unknown", "failed"], up.stdout
    assert _row(up.stdout, "u1")[2:5] == ["unknown", "unknown", "not started"], up.stdout

    ok = run_cli(["migrate", "up", str(map_path), "--server", "u1", "--json"], env=env)
    assert ok.returncode == 0, (ok.stdout, ok.stderr)
    assert '"before": null' in ok.stdout and '"before_known": true' in ok.stdout  # read at base: known


@pytest.mark.slow  # 53 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_revision_file_with_a_syntax_error_is_one_line_naming_the_file(tmp_path: Path) -> None:
    map_path, root = _fleet(tmp_path)
    broken = root / "user" / "versions" / "b2_broken.py"
    broken.write_text(REV1.replace('"a1"', '"b2"').replace("down_revision = None", 'down_revision = "a1"')
                      .replace("def upgrade() -> None:", "def upgrade( -> None:"), encoding="utf-8")
    for command in ("status", "up"):
        done = run_cli(["migrate", command, str(map_path)])
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "b2_broken.py" in lines[0] and "line 11" in lines[0], done.stderr


@pytest.mark.slow  # 41 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_revision_whose_sql_fails_names_the_revision_not_schema_apply(tmp_path: Path) -> None:
    """A revision's own bad SQL (a table it misspelled) was hinted "(run `mdb schema apply MAP`)": the cause is the revision."""
    map_path, root = _fleet(tmp_path)
    (root / "user" / "versions" / "b2_bad_sql.py").write_text(
        REV1.replace('"a1"', '"b2"').replace("down_revision = None", 'down_revision = "a1"')
        .replace('op.create_table("mig_extra", sa.Column("id", sa.Integer(), primary_key=True))',
                 'op.execute("UPDATE mig_extar SET id = 1")'), encoding="utf-8")
    done = run_cli(["migrate", "up", str(map_path), "--parallel", "1"], env={"COLUMNS": "250"})
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "the revision's SQL failed" in done.stdout and "mig_extar" in done.stdout, done.stdout
    assert "schema apply" not in done.stdout + done.stderr, done.stdout
