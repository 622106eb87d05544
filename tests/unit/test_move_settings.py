"""The moves' settings read from the environment when used: a bad value names its variable."""

from __future__ import annotations

import pytest

from mdb.errors import MdbError
from mdb.moves.jobs import item_briefcases


def test_item_briefcases_defaults_to_200_and_takes_a_whole_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MDB_ITEM_BRIEFCASES", raising=False)
    assert item_briefcases() == 200
    monkeypatch.setenv("MDB_ITEM_BRIEFCASES", "7")
    assert item_briefcases() == 7


@pytest.mark.parametrize(("raw", "says"), [("lots", "is not a whole number"), ("2.5", "is not a whole number"), ("0", "must be at least 1"), ("-3", "must be at least 1")])
def test_a_bad_item_size_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str, says: str) -> None:
    monkeypatch.setenv("MDB_ITEM_BRIEFCASES", raw)
    with pytest.raises(MdbError, match=f"MDB_ITEM_BRIEFCASES={raw!r} {says}".replace(".", r"\.")):
        item_briefcases()
