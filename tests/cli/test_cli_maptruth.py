"""One truth about the map (issue 11, items 4 and 5) and the CLI's exit codes, through the CLI.

After ``mdb map apply MAP NEW`` the file MAP still says the old version; every command must
route with the newest applied map anyway (as ``Store.refresh`` does) and say that the file is
older. Relative SQLite paths point next to the map file, wherever ``mdb`` runs from. Runs on
SQLite files (the embedded default) with the demo's briefcase types; one case uses a closed
PostgreSQL port for "server unavailable".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mdb.cli import main
from mdb.cli.app import EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_RETRY, EXIT_UNAVAILABLE, exit_code
from mdb.errors import BriefcaseMovingError, MapError, ServerUnavailableError, StaleRouteError

NEW_START = 1_000_000


def map_text(version: int, *, second_partition: bool) -> str:
    """A map with relative SQLite paths (``data/...``): they mean "next to this file"."""
    parts = '      - {start: "0:0:0", shards: [u1]}\n'
    if second_partition:
        parts += f'      - {{start: "0:0:{NEW_START}", shards: [u2]}}\n'
    return (
        f"version: {version}\nmodels: [mdb.demo.models]\nservers:\n"
        '  c: {primary: "sqlite:///data/c.db"}\n  u1: {primary: "sqlite:///data/u1.db"}\n'
        '  u2: {primary: "sqlite:///data/u2.db"}\n  u3: {primary: "sqlite:///data/u3.db"}\n'
        f"areas:\n  central: {{kind: central, shards: [c]}}\n  user:\n    partitions:\n{parts}"
    )


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["mdb", *args])
    with pytest.raises(SystemExit) as info:
        main()
    out, err = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 0), out, err


@pytest.fixture
def system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path, Path]:
    """maps/v1.yaml applied with schema apply, then maps/v2.yaml (a new partition) applied.

    Every command runs from another folder (``elsewhere``), as an operator's shell would.
    """
    maps = tmp_path / "maps"
    maps.mkdir()
    v1, v2 = maps / "v1.yaml", maps / "v2.yaml"
    v1.write_text(map_text(1, second_partition=False))
    v2.write_text(map_text(2, second_partition=True))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = run(monkeypatch, capsys, "schema", "apply", str(v1))
    assert code == 0, (out, err)
    code, out, err = run(monkeypatch, capsys, "map", "apply", str(v1), str(v2))
    assert code == 0, (out, err)
    return v1, v2, elsewhere


def test_relative_sqlite_paths_resolve_next_to_the_map(system: tuple[Path, Path, Path]) -> None:
    v1, _v2, elsewhere = system
    assert sorted(p.name for p in (v1.parent / "data").glob("*.db")) == ["c.db", "u1.db", "u2.db", "u3.db"]
    assert list(elsewhere.iterdir()) == []  # nothing created where mdb ran


def test_route_and_where_agree_after_map_apply(system: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    v1, _v2, _ = system
    gdid = f"0:0:{NEW_START + 2}"
    code, out, err = run(monkeypatch, capsys, "route", str(v1), "user", gdid, "--json")
    assert code == 0, err
    route = json.loads(out)
    assert (route["server"], route["map_version"]) == ("u2", 2)
    assert f"map file {v1} is v1; the system runs v2" in err and len(err.splitlines()) == 1
    code, out, err = run(monkeypatch, capsys, "where", str(v1), "user", gdid, "--json")
    assert code == EXIT_NOT_FOUND, err  # nobody holds it yet: "not found"
    assert json.loads(out)["routed_to"] == route["server"]


def test_schema_apply_and_map_show_use_the_applied_map(system: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    v1, _v2, _ = system
    code, out, err = run(monkeypatch, capsys, "schema", "apply", str(v1), "--json")
    assert code == 0, (out, err)
    assert json.loads(out)["map_version"] == 2
    code, out, err = run(monkeypatch, capsys, "map", "show", str(v1), "--json")
    assert code == 0 and json.loads(out)["version"] == 2
    assert [p["start"] for p in json.loads(out)["partitions"]] == ["0:0:0", f"0:0:{NEW_START}"]
    code, out, err = run(monkeypatch, capsys, "map", "check", str(v1), "--json")  # check is about the file
    assert code == 0 and json.loads(out)["version"] == 1 and "partitions" in out


def test_map_pull_updates_the_file(system: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    v1, v2, _ = system
    code, out, err = run(monkeypatch, capsys, "map", "pull", str(v1))
    assert code == 0 and out == v2.read_text()  # the text as applied, unexpanded
    code, out, err = run(monkeypatch, capsys, "map", "pull", str(v1), "-o", str(v1))
    assert code == 0, err
    assert yaml.safe_load(v1.read_text())["version"] == 2
    code, out, err = run(monkeypatch, capsys, "route", str(v1), "user", "0:0:5", "--json")
    assert code == 0 and err == ""  # the file is current: no note


def test_map_pull_before_any_apply_is_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(map_text(1, second_partition=False))
    code, out, err = run(monkeypatch, capsys, "schema", "apply", str(path))
    assert code == 0, err
    code, out, err = run(monkeypatch, capsys, "map", "pull", str(path))
    assert code == EXIT_NOT_FOUND and "no map has been applied" in out


def test_pure_commands_create_nothing_before_the_system_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(map_text(1, second_partition=False))
    for args in (["route", str(path), "user", "0:0:1"], ["central-shard", str(path), "k"], ["map", "show", str(path)]):
        code, out, err = run(monkeypatch, capsys, *args)
        assert code == 0 and err == "", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.yaml"]


def test_route_falls_back_to_the_file_when_central_is_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(map_text(1, second_partition=False).replace("sqlite:///data/c.db", "postgresql+psycopg://postgres@127.0.0.1:1/c"))
    code, out, err = run(monkeypatch, capsys, "route", str(path), "user", "0:0:1", "--json")
    assert code == 0 and json.loads(out)["server"] == "u1"
    assert "cannot read the applied map from CENTRAL" in err and f"using map file {path} v1" in err


# -- exit codes (docs/cli.md) ----------------------------------------------------------------------------


def test_a_server_that_is_down_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(map_text(1, second_partition=False).replace("sqlite:///data/c.db", "postgresql+psycopg://postgres@127.0.0.1:1/c"))
    code, out, err = run(monkeypatch, capsys, "map", "history", str(path))
    assert code == EXIT_UNAVAILABLE and out == ""
    assert err.startswith("error: server 'c' is unavailable") and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "exc, code",
    [
        (ServerUnavailableError("s", "refused"), EXIT_UNAVAILABLE),
        (StaleRouteError("stale"), EXIT_RETRY),
        (BriefcaseMovingError("moving"), EXIT_RETRY),
        (MapError("bad"), EXIT_REFUSED),
    ],
)
def test_exit_code_of_each_error_kind(exc: Exception, code: int) -> None:
    assert exit_code(exc) == code  # type: ignore[arg-type]


SIGTERM_WHILE_STARTING = """
import os, signal, typer.main
from mdb.cli import main
build = typer.main.get_command
def build_then_signalled(app):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives while typer is still building the command, before click's handler
    return build(app)
typer.main.get_command = build_then_signalled
main()
"""


def test_sigterm_while_the_command_is_still_being_built_exits_143_without_a_traceback() -> None:
    proc = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_STARTING, "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr


def test_version_and_usage(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(monkeypatch, capsys, "--version")
    assert code == 0 and out.startswith("mdb ")
    code, out, _ = run(monkeypatch, capsys, "route", "--help")
    assert code == 0
    assert "mdb route [OPTIONS] MAP AREA GDID" in out and "{" not in out and "<bool>" not in out


def test_unknown_high_water_area_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    old, new = tmp_path / "v1.yaml", tmp_path / "v2.yaml"
    old.write_text(map_text(1, second_partition=False))
    new.write_text(map_text(2, second_partition=True))
    code, out, err = run(monkeypatch, capsys, "map", "diff", str(old), str(new), "--high-water", "nope=0:0:1")
    assert code == EXIT_REFUSED and out == ""
    assert "--high-water nope=...: map version 1 has no partitioned area 'nope' (it has: user)" in err
    code, out, err = run(monkeypatch, capsys, "map", "diff", str(old), str(new), "--high-water", "user=0:0:1", "--json")
    assert code == 0 and json.loads(out)["ok"], err


def test_repr_of_a_store_shows_the_version_it_routes_with(system: tuple[Path, Path, Path]) -> None:
    from mdb import Store

    v1, _v2, _ = system
    with Store.from_yaml(v1, types=[]) as store:
        assert repr(store).startswith(f"Store(map_version=1, map_source='{v1}', refreshed=False,")
        store.refresh()
        assert repr(store).startswith("Store(map_version=2, map_source=\"mdb_maps version 2 on server 'c'\", refreshed=True,")


def test_route_does_not_wait_for_a_central_that_never_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A CENTRAL behind a firewall that drops packets: the connect hangs until the TCP timeout."""
    import importlib
    import threading

    app_module = importlib.import_module("mdb.cli.app")  # `mdb.cli.app` the attribute is the Typer app

    path = tmp_path / "m.yaml"
    path.write_text(map_text(1, second_partition=False))
    silent = threading.Event()
    monkeypatch.setattr(app_module, "CENTRAL_WAIT_SECONDS", 0.2)
    monkeypatch.setattr(app_module, "_newest_map", lambda pmap, _path: silent.wait(60) and pmap)
    try:
        code, out, err = run(monkeypatch, capsys, "route", str(path), "user", "0:0:1", "--json")
    finally:
        silent.set()
    assert code == 0 and json.loads(out)["server"] == "u1"
    assert "CENTRAL did not answer within 0.2 s" in err and f"using map file {path} v1" in err


def test_reshard_with_an_older_map_file_builds_on_the_applied_map(system: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The file says v1 (one partition); the system runs v2 (two). The new map is v2 + the reshard:
    built from the file it said "partition 0:0:1000000 is removed" and refused."""
    v1, _v2, _ = system
    code, out, err = run(monkeypatch, capsys, "reshard", str(v1), "user", "--partition", "0:0:0", "--shards", "u1,u3")
    assert code == 0, (out, err)
    code, out, err = run(monkeypatch, capsys, "map", "show", str(v1), "--json")
    shown = json.loads(out)
    assert shown["version"] == 3
    assert [(p["start"], p["shards"]) for p in shown["partitions"]] == [("0:0:0", ["u1", "u3"]), (f"0:0:{NEW_START}", ["u2"])]


def test_where_with_a_shard_unreachable_is_unavailable_not_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Nobody was seen holding the briefcase, but u3 could not be asked: the answer is unknown, so
    exit 3 (unavailable), never 1, which a script would read as "the briefcase does not exist"."""
    path = tmp_path / "m.yaml"
    path.write_text(map_text(1, second_partition=False).replace("sqlite:///data/u3.db", "postgresql+psycopg://postgres@127.0.0.1:1/u3"))
    code, out, err = run(monkeypatch, capsys, "schema", "apply", str(path))
    assert code == 1 and "u3" in out, (out, err)  # every other server prepared
    for args in (("where", str(path), "user", "0:0:5"), ("where", str(path), "user", "0:0:5", "--json")):
        code, out, err = run(monkeypatch, capsys, *args)
        assert code == EXIT_UNAVAILABLE, (code, out, err)
        assert "u3" in out


def test_models_beside_the_map_are_found_from_another_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The README's layout (my-map.yaml beside myapp/) used from another folder: `models:` is
    found next to the map file, as its relative SQLite paths are (it failed: "No module named")."""
    app_dir = tmp_path / "tour"
    (app_dir / "tourapp_beside").mkdir(parents=True)
    (app_dir / "tourapp_beside" / "__init__.py").write_text("")
    (app_dir / "tourapp_beside" / "models.py").write_text("from mdb.demo.models import UserBriefcase  # noqa: F401\n")
    path = app_dir / "my-map.yaml"
    path.write_text(map_text(1, second_partition=False).replace("models: [mdb.demo.models]", "models: [tourapp_beside.models]"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(elsewhere))])
    code, out, err = run(monkeypatch, capsys, "schema", "apply", str(path))
    assert code == 0, (out, err)
    code, out, err = run(monkeypatch, capsys, "where", str(path), "user", "0:0:5")
    assert code == EXIT_NOT_FOUND and "no server holds" in out, (out, err)
