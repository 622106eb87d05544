"""The read-only ``mdb`` commands: gdid, route, central-shard, map check, map show.

Output is checked through typer's CliRunner; error handling (exit code 2, one ``error:`` line on
stderr, no traceback) lives in ``mdb.cli.main`` and is checked by calling ``main()`` with a
patched ``sys.argv`` and by running the installed ``mdb`` console script in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import forkserver
from typer.testing import CliRunner

from mdb import GDID, MdbError
from mdb.cli import app, main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "partition_maps" / "example.yaml"
EXAMPLE_DATA = (REPO / "partition_maps").resolve() / "mdb-data"  # relative SQLite paths: next to the map
MDB = Path(sys.executable).parent / "mdb"
SECRET = "Sw0rdfish-9f7c"

runner = CliRunner()


def fnv1a_64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return h


def invoke_json(*args: str, env: dict[str, str] | None = None) -> dict:
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return json.loads(result.stdout)


@pytest.fixture
def secret_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MDB_TEST_CLI_PW", SECRET)
    path = tmp_path / "secret.yaml"
    path.write_text(
        """\
version: 7
servers:
  central-a: {primary: "postgresql+psycopg://mdb:${MDB_TEST_CLI_PW}@10.0.0.5/central_a"}
  user-1:
    primary: "postgresql+psycopg://mdb:${MDB_TEST_CLI_PW}@10.0.0.6/user_1"
    replica: "postgresql+psycopg://ro:${MDB_TEST_CLI_PW}@10.0.0.16/user_1?password=${MDB_TEST_CLI_PW}"
  user-2: {primary: "sqlite:///mdb-data/user-2.db"}
areas:
  central: {kind: central, shards: [central-a]}
  user:
    partitions:
      - {start: "0:0:0", shards: [user-1, user-2]}
"""
    )
    return path


# -- mdb gdid -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1293:3:57", "0000050d3000000000000039", " 1293 : 3 : 57 ", "0X0000050D3000000000000039"])
def test_gdid_json(value: str) -> None:
    data = invoke_json("gdid", value, "--json")
    assert data["text"] == "1293:3:57"
    assert data["hex"] == "0000050d3000000000000039"
    assert (data["era"], data["authority"], data["counter"]) == (1293, 3, 57)
    assert data["raw_id"] == 3 << 60 | 57


def test_gdid_explicit_show_subcommand() -> None:
    assert invoke_json("gdid", "show", "0:0:1", "--json")["hex"] == "0" * 23 + "1"


def test_gdid_table() -> None:
    result = runner.invoke(app, ["gdid", "1293:3:57"])
    assert result.exit_code == 0
    for expected in ("1293:3:57", "0000050d3000000000000039", "1293", "57"):
        assert expected in result.stdout


def test_gdid_bad_value_is_an_mdb_error() -> None:
    result = runner.invoke(app, ["gdid", "1:2", "--json"])
    assert result.exit_code != 0 and isinstance(result.exception, MdbError)
    assert result.stdout == ""


# -- mdb route --------------------------------------------------------------------------------------------


def test_route_issue_must_show() -> None:
    data = invoke_json("route", str(EXAMPLE), "user", "0:0:250001", "--json")
    assert data["area"] == "user"
    assert data["gdid"] == "0:0:250001"
    assert data["range_set"] == "0:0:0"
    assert data["partition_start"] == "0:0:250000"
    assert data["shard_index"] == 2
    assert data["shard_count"] == 3
    assert data["server"] == "user-5"
    assert data["url"] == f"sqlite:///{EXAMPLE_DATA}/user-5.db"
    assert data["map_version"] == 3


def test_route_archive_with_breakpoint() -> None:
    data = invoke_json("route", str(EXAMPLE), "archive", "0:0:100050001", "--json")
    assert (data["range_set"], data["partition_start"], data["server"]) == ("0:0:100000000", "0:0:100050000", "user-9")
    data = invoke_json("route", str(EXAMPLE), "archive", "0000000000000000061c4681", "--json")  # hex of 0:0:102516353
    assert data["gdid"] == "0:0:102516353" and data["server"] == "user-9"


def test_route_table_explains_the_placement() -> None:
    result = runner.invoke(app, ["route", str(EXAMPLE), "user", "0:0:250001"])
    assert result.exit_code == 0
    for expected in ("user-5", "0:0:250000", f"sqlite:///{EXAMPLE_DATA}/user-5.db"):
        assert expected in result.stdout


def test_route_masks_urls(secret_map: Path) -> None:
    result = runner.invoke(app, ["route", str(secret_map), "user", "0:0:2", "--json"])
    assert result.exit_code == 0
    assert SECRET not in result.stdout
    data = json.loads(result.stdout)
    assert data["server"] == "user-1"
    assert data["url"] == "postgresql+psycopg://mdb:***@10.0.0.6/user_1"
    assert data["replica_url"] == "postgresql+psycopg://ro:***@10.0.0.16/user_1?password=***"
    table = runner.invoke(app, ["route", str(secret_map), "user", "0:0:2"])
    assert table.exit_code == 0 and SECRET not in table.stdout


# -- mdb central-shard --------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["ann@example.com", "Zoë", "foobar"])
def test_central_shard(key: str) -> None:
    data = invoke_json("central-shard", str(EXAMPLE), key, "--json")
    assert data["area"] == "central"
    assert data["key"] == key
    assert data["fnv1a_64"] == fnv1a_64(key.encode("utf-8"))
    assert (data["shard_index"], data["shard_count"], data["server"]) == (0, 1, "central-a")


def test_keys_that_look_like_emoji_codes_print_as_given() -> None:
    """rich turns ``:fire:`` into an emoji unless the console is told not to."""
    result = runner.invoke(app, ["central-shard", str(EXAMPLE), "tag:fire:1"])
    assert result.exit_code == 0, result.stdout
    assert "tag:fire:1" in result.stdout and "\N{FIRE}" not in result.stdout


def test_central_shard_several_shards(tmp_path: Path) -> None:
    path = tmp_path / "c3.yaml"
    path.write_text(
        "version: 1\nservers:\n"
        + "".join(f'  c{i}: {{primary: "sqlite:///c{i}.db"}}\n' for i in range(3))
        + "areas:\n  central: {kind: central, shards: [c2, c0, c1]}\n"
    )
    data = invoke_json("central-shard", str(path), "foobar", "--json")
    assert data["fnv1a_64"] == 0x85944171F73967E8
    assert data["shard_index"] == 0x85944171F73967E8 % 3
    assert data["server"] == ["c2", "c0", "c1"][0x85944171F73967E8 % 3]


# -- mdb map check / show ------------------------------------------------------------------------------------


def test_map_check_ok() -> None:
    result = runner.invoke(app, ["map", "check", str(EXAMPLE)], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "ok" in result.stdout and "version 3" in result.stdout
    assert "10 servers" in result.stdout and "5 partitions" in result.stdout


def test_map_show_lists_servers_and_partitions() -> None:
    result = runner.invoke(app, ["map", "show", str(EXAMPLE)], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    out = result.stdout
    for expected in ("central-a", "user-9", f"sqlite:///{EXAMPLE_DATA}/user-7.db", "0:0:250000", "0:0:100050000", "user-3, user-4, user-5"):
        assert expected in out


def test_map_show_masks_passwords(secret_map: Path) -> None:
    result = runner.invoke(app, ["map", "show", str(secret_map)], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    assert SECRET not in result.stdout and SECRET not in result.stderr
    assert "mdb:***@10.0.0.5/central_a" in result.stdout
    assert "ro:***@10.0.0.16/user_1?password=***" in result.stdout


# -- errors through main(): exit 2, one line, no traceback -----------------------------------------------------


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["mdb", *args])
    with pytest.raises(SystemExit) as info:
        main()
    out, err = capsys.readouterr()
    return info.value.code, out, err


def assert_one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    assert lines[0].startswith("error:"), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["gdid", "1:2"], "'1:2'"),
        (["gdid", "0:16:0", "--json"], "'0:16:0'"),
        (["gdid", "zz"], "'zz'"),
        (["route", str(EXAMPLE), "user", "0:0:+1"], "'0:0:+1'"),
        (["route", str(EXAMPLE), "orders", "0:0:1"], f"unknown area 'orders' (map version 3 in {EXAMPLE} has: user, archive)"),
        (["route", str(EXAMPLE), "central", "0:0:1", "--json"], "central"),
        (["route", str(EXAMPLE), "user", "0:0:0"], "0:0:0"),
        (["route", str(EXAMPLE), "user", "12:x:5"], "'12:x:5'"),  # not rich's emoji code :x:
        # bytes in argv that are not UTF-8 arrive as lone surrogates
        (["central-shard", str(EXAMPLE), "\udcff\udcfe@x"], "'\\udcff\\udcfe@x' has surrogates not allowed at position 0"),
    ],
)
def test_bad_input_via_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], needle: str) -> None:
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert code == 2
    assert out == ""
    assert needle in assert_one_error_line(err)


def test_broken_map_via_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: 1\nservers: {a: {primary: x}}\nareas:\n  central: {kind: central, shards: [a, b]}\n")
    for args in (["map", "check", str(broken)], ["map", "show", str(broken)], ["route", str(broken), "user", "0:0:1"],
                 ["central-shard", str(broken), "k"]):
        code, out, err = run_main(monkeypatch, capsys, *args)
        assert code == 2 and out == ""
        line = assert_one_error_line(err)
        assert f"{broken}:4:" in line and "unknown server 'b'" in line


def test_missing_map_via_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _out, err = run_main(monkeypatch, capsys, "map", "check", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert str(tmp_path / "nope.yaml") in assert_one_error_line(err)


def test_map_errors_do_not_leak_secrets(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], secret_map: Path) -> None:
    secret_map.write_text(secret_map.read_text().replace("shards: [central-a]", "shards: [central-a, nope]"))
    code, out, err = run_main(monkeypatch, capsys, "map", "show", str(secret_map))
    assert code == 2 and SECRET not in err and SECRET not in out
    assert "unknown server 'nope'" in assert_one_error_line(err)


# -- the installed console script ------------------------------------------------------------------------------


def run_mdb(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "COLUMNS": "250", **(env or {})}
    return forkserver.run([str(MDB), *args], capture_output=True, text=True, cwd=cwd, env=full_env, timeout=60)


def test_console_script_route_must_show() -> None:
    assert MDB.exists(), f"the mdb console script is not installed next to {sys.executable}"
    proc = run_mdb("route", "partition_maps/example.yaml", "user", "0:0:250001", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["partition_start"], data["shard_index"], data["server"]) == ("0:0:250000", 2, "user-5")


def test_console_script_gdid() -> None:
    proc = run_mdb("gdid", "1293:3:57", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["hex"] == "0000050d3000000000000039"
    assert GDID.parse(json.loads(proc.stdout)["text"]) == GDID(1293, 3, 57)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["gdid", "1:2:3:4"], "'1:2:3:4'"),
        (["route", "partition_maps/example.yaml", "nope", "0:0:1", "--json"], "'nope'"),
        (["map", "check", "partition_maps/does-not-exist.yaml"], "does-not-exist.yaml"),
    ],
)
def test_console_script_errors(args: list[str], needle: str) -> None:
    proc = run_mdb(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert needle in assert_one_error_line(proc.stderr)


def test_console_script_key_that_is_not_utf8() -> None:
    proc = subprocess.run([str(MDB), "central-shard", "partition_maps/example.yaml", b"\xff\xfe@example.com"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert "a CENTRAL key must be text UTF-8 can encode" in assert_one_error_line(proc.stderr)


def test_console_script_broken_map_long_path(tmp_path: Path) -> None:
    # a long message must stay one line even on a narrow terminal
    deep = tmp_path / ("very-long-directory-name-" * 4)
    deep.mkdir()
    broken = deep / "broken.yaml"
    broken.write_text("version: 1\nservers: {a: {primary: x}}\nareas:\n  central: {kind: central, shards: [a]}\n  user: {partitions: [{start: '0:0:0', shards: []}]}\n")
    proc = run_mdb("map", "check", str(broken), env={"COLUMNS": "40"})
    assert proc.returncode == 2
    line = assert_one_error_line(proc.stderr)
    assert f"{broken}:5:" in line and "shards list is empty" in line


@pytest.mark.slow  # 28 s measured at load ~15 on 2 cores: docs/testing.md
def test_console_script_missing_env_var_and_masking(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MDB_PG_PASSWORD"}
    proc = subprocess.run([str(MDB), "map", "check", "partition_maps/production-postgres.yaml"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert proc.returncode == 2
    assert "MDB_PG_PASSWORD is not set" in assert_one_error_line(proc.stderr)

    proc = run_mdb("map", "show", "partition_maps/production-postgres.yaml", env={"MDB_PG_PASSWORD": SECRET})
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout and SECRET not in proc.stderr
    assert "mdb:***@10.0.0.5/central_a" in proc.stdout


def test_console_script_signed_gdid_is_one_error_line() -> None:
    proc = run_mdb("gdid", "-1:0:0")
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr)


def test_map_show_and_check_json(secret_map: Path) -> None:
    shown = runner.invoke(app, ["map", "show", str(secret_map), "--json"])
    assert shown.exit_code == 0 and SECRET not in shown.stdout
    data = json.loads(shown.stdout)
    assert data["version"] == 7 and data["central"] == {"area": "central", "shards": ["central-a"]}
    assert data["servers"]["user-1"]["replica"] == "postgresql+psycopg://ro:***@10.0.0.16/user_1?password=***"
    assert data["partitions"] == [{"area": "user", "range_set": "0:0:0", "start": "0:0:0", "shards": ["user-1", "user-2"]}]
    checked = invoke_json("map", "check", str(EXAMPLE), "--json")
    identities = checked.pop("identities")  # tests/postgres/test_server_identity.py checks what it says
    assert checked == {"map": str(EXAMPLE), "ok": True, "version": 3, "servers": 10, "areas": 3, "partitions": 5, "problems": []}
    assert set(identities) == {"checked", "not_checked", "servers"}


def test_map_check_counts_in_the_singular(tmp_path: Path) -> None:
    path = tmp_path / "one.yaml"
    path.write_text('version: 1\nservers:\n  c: {primary: "sqlite:///c.db"}\nareas:\n  central: {kind: central, shards: [c]}\n')
    result = runner.invoke(app, ["map", "check", str(path)])
    assert result.exit_code == 0 and "1 server, 1 area, 0 partitions" in result.stdout
