"""``pooler:`` and ``direct:`` in the map: validated, masked, and the URL each connection takes."""

from __future__ import annotations

import pytest

from mdb.engines import EngineRegistry
from mdb.errors import MapEditError, MapError
from mdb.maps.diff import diff_maps
from mdb.maps.text import recordable_yaml
from mdb.partition_map import parse_map
from mdb.urls import mask_url

POOLED = "postgresql://mdb:s3cret@10.0.0.5:6432/user_1"
DIRECT = "postgresql://mdb:s3cret@10.0.0.5:5432/user_1"
REPLICA = "postgresql://mdb:s3cret@10.0.0.16:6432/user_1"


def _map(server: str) -> str:
    return f"version: 1\nservers:\n  u1: {server}\nareas:\n  central: {{kind: central, shards: [u1]}}\n"


def test_pooler_and_direct_parse_and_default_to_none() -> None:
    spec = parse_map(_map(f'{{primary: "{POOLED}", pooler: transaction, direct: "{DIRECT}"}}')).servers["u1"]
    assert (spec.pooler, spec.direct) == ("transaction", DIRECT)
    plain = parse_map(_map(f'{{primary: "{POOLED}"}}')).servers["u1"]
    assert (plain.pooler, plain.direct) == ("none", None)


def test_the_direct_url_is_masked_and_an_old_map_dumps_unchanged() -> None:
    pmap = parse_map(_map(f'{{primary: "{POOLED}", pooler: transaction, direct: "{DIRECT}"}}'))
    assert "s3cret" not in repr(pmap.servers["u1"]) and "5432" in repr(pmap.servers["u1"])
    assert "pooler" not in parse_map(_map(f'{{primary: "{POOLED}"}}')).to_yaml()


@pytest.mark.parametrize(
    ("server", "problem"),
    [
        ('{primary: "sqlite:///x.db", pooler: transaction}', "pooler: transaction needs a PostgreSQL primary URL"),
        (f'{{primary: "{POOLED}", direct: "{DIRECT}"}}', "direct: is the way around a pooler"),
        (f'{{primary: "{POOLED}", pooler: transaction, direct: "sqlite:///x.db"}}', "must be a PostgreSQL URL"),
        (f'{{primary: "{POOLED}", pooler: session}}', "servers.u1.pooler"),
    ],
)
def test_a_pooler_setting_that_cannot_work_is_refused_with_the_reason(server: str, problem: str) -> None:
    with pytest.raises(MapError, match=problem) as raised:
        parse_map(_map(server))
    assert "<map>:3" in str(raised.value) and "s3cret" not in str(raised.value)


def test_only_the_tools_take_the_direct_url_and_only_for_the_primary() -> None:
    pmap = parse_map(_map(f'{{primary: "{POOLED}", replica: "{REPLICA}", pooler: transaction, direct: "{DIRECT}"}}'))
    app = EngineRegistry.for_map(pmap)
    assert (app.url("u1"), app.pooled("u1")) == (POOLED, True)
    tools = EngineRegistry.for_map(pmap)
    tools.use_direct()
    assert (tools.url("u1"), tools.pooled("u1")) == (DIRECT, False)
    assert (tools.url("u1", readonly=True), tools.pooled("u1", readonly=True)) == (REPLICA, True)
    assert "s3cret" not in tools.masked_url("u1")


def test_map_diff_shows_a_pooler_change_masked_and_accepts_it() -> None:
    old = parse_map(_map(f'{{primary: "{DIRECT}"}}'))
    new = parse_map(_map(f'{{primary: "{POOLED}", pooler: transaction, direct: "{DIRECT}"}}').replace("version: 1", "version: 2"))
    diff = diff_maps(old, new, {})
    (change,) = [c for c in diff.changes if c.subject == "server u1 pooler"]
    assert change.accepted and change.old == "pooler none" and change.new == "pooler transaction, direct " + mask_url(DIRECT)
    assert "s3cret" not in str(diff.to_json())


def test_an_applied_map_never_records_a_literal_password_in_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PW", "s3cret")
    text = _map(f'{{primary: "postgresql://mdb:${{PW}}@h:6432/u", pooler: transaction, direct: "{DIRECT}"}}')
    with pytest.raises(MapEditError, match="direct URL .* carries a literal password") as raised:
        recordable_yaml(parse_map(text), text)
    assert "s3cret" not in str(raised.value)
    recordable_yaml(parse_map(text.replace("s3cret", "${PW}")), text.replace("s3cret", "${PW}"))  # a reference is fine
