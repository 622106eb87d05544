"""GDID value type: the formats fixed by docs/design.md, ordering, errors, pydantic and SQL storage."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

import mdb
from mdb import GDID, GDIDError, GDIDType

MAX_ERA = 2**32 - 1
MAX_AUTHORITY = 15
MAX_COUNTER = 2**60 - 1

eras = st.integers(0, MAX_ERA)
authorities = st.integers(0, MAX_AUTHORITY)
counters = st.integers(0, MAX_COUNTER)
gdids = st.builds(GDID, eras, authorities, counters)
nonzero_gdids = gdids.filter(lambda g: (g.era, g.authority, g.counter) != (0, 0, 0))
# Horizontal whitespace a person might type around a number.
spaces = st.text(alphabet=" \t", max_size=3)


def reference_bytes(era: int, authority: int, counter: int) -> bytes:
    """docs/design.md: 12 bytes, big-endian era then big-endian raw id (authority << 60 | counter)."""
    return era.to_bytes(4, "big") + (authority << 60 | counter).to_bytes(8, "big")


def assert_refused(text: str) -> GDIDError:
    with pytest.raises(GDIDError) as info:
        GDID.parse(text)
    err = info.value
    assert isinstance(err, ValueError)
    assert isinstance(err, mdb.MdbError)
    assert repr(text) in str(err), f"message does not quote the input {text!r}: {err}"
    return err


# -- known vectors -----------------------------------------------------------------------------


def test_known_vector_text_to_hex() -> None:
    g = GDID.parse("1293:3:57")
    assert g.hex == "0000050d3000000000000039"
    assert (g.era, g.authority, g.counter) == (1293, 3, 57)
    assert str(g) == "1293:3:57"
    assert GDID.parse("0000050d3000000000000039") == g


def test_known_vector_bytes() -> None:
    assert bytes(GDID(1, 0, 1)) == b"\x00\x00\x00\x01" + (1).to_bytes(8, "big")
    assert bytes(GDID(0, 15, MAX_COUNTER)) == b"\x00" * 4 + b"\xff" * 8
    assert bytes(GDID(MAX_ERA, 0, 0)) == b"\xff" * 4 + b"\x00" * 8
    assert GDID(0, 1, 0).raw_id == 2**60
    assert GDID(0, 1, 0).hex == "000000001000000000000000"


def test_public_api_is_exported() -> None:
    assert mdb.GDID is GDID
    assert issubclass(mdb.GDIDError, ValueError)
    assert GDID.from_bytes(bytes(GDID(7, 1, 9))) == GDID(7, 1, 9)


def test_zero_gdid() -> None:
    zero = GDID(0, 0, 0)
    assert zero == GDID.ZERO == GDID.parse("0:0:0") == GDID.parse("0" * 24)
    assert zero.is_zero
    assert not zero
    assert str(zero) == "0:0:0"
    assert zero.hex == "0" * 24
    assert bytes(zero) == b"\x00" * 12
    for g in (GDID(0, 0, 1), GDID(0, 1, 0), GDID(1, 0, 0)):
        assert not g.is_zero
        assert g
        assert g > zero


# -- round trips ---------------------------------------------------------------------------------


@given(eras, authorities, counters)
def test_forms_round_trip(era: int, authority: int, counter: int) -> None:
    g = GDID(era, authority, counter)
    assert (g.era, g.authority, g.counter) == (era, authority, counter)
    assert g.raw_id == authority << 60 | counter

    assert str(g) == f"{era}:{authority}:{counter}"
    assert GDID.parse(str(g)) == g

    assert g.hex == reference_bytes(era, authority, counter).hex()
    assert len(g.hex) == 24 and g.hex == g.hex.lower()
    assert GDID.parse(g.hex) == g
    assert GDID.parse(g.hex.upper()) == g
    assert GDID.parse("0x" + g.hex) == g
    assert GDID.parse("0X" + g.hex.upper()) == g

    assert bytes(g) == reference_bytes(era, authority, counter)
    assert GDID.from_bytes(bytes(g)) == g
    assert GDID.from_bytes(bytearray(bytes(g))) == g
    assert GDID.from_bytes(memoryview(bytes(g))) == g


@given(gdids, spaces, spaces, spaces, spaces, spaces, spaces)
def test_text_accepts_spaces_around_each_number(g: GDID, a: str, b: str, c: str, d: str, e: str, f: str) -> None:
    text = f"{a}{g.era}{b}:{c}{g.authority}{d}:{e}{g.counter}{f}"
    assert GDID.parse(text) == g


@given(gdids, spaces, spaces)
def test_hex_trims_surrounding_whitespace(g: GDID, before: str, after: str) -> None:
    assert GDID.parse(f"{before}\n{g.hex}{after}\n") == g
    assert GDID.parse(f"{before}0x{g.hex}{after}") == g


@given(gdids, st.lists(st.booleans(), min_size=24, max_size=24))
def test_hex_is_case_insensitive(g: GDID, upper: list[bool]) -> None:
    mixed = "".join(ch.upper() if u else ch for ch, u in zip(g.hex, upper))
    assert GDID.parse(mixed) == g


def test_leading_zeros_in_text_are_decimal_not_octal() -> None:
    assert GDID.parse("010:00:0010") == GDID(10, 0, 10)


# -- ordering, equality, hashing -------------------------------------------------------------------


@given(gdids, gdids)
def test_order_equals_byte_order_equals_era_raw_order(a: GDID, b: GDID) -> None:
    key_a = (a.era, a.authority << 60 | a.counter)
    key_b = (b.era, b.authority << 60 | b.counter)
    assert (a < b) == (bytes(a) < bytes(b)) == (key_a < key_b) == (a.hex < b.hex)
    assert (a <= b) == (bytes(a) <= bytes(b)) == (key_a <= key_b)
    assert (a > b) == (bytes(a) > bytes(b)) == (key_a > key_b)
    assert (a >= b) == (bytes(a) >= bytes(b)) == (key_a >= key_b)
    assert (a == b) == (bytes(a) == bytes(b)) == (key_a == key_b)
    assert (a != b) == (key_a != key_b)


@given(st.lists(gdids, max_size=30))
def test_sorting_matches_bytes(values: list[GDID]) -> None:
    assert [bytes(g) for g in sorted(values)] == sorted(bytes(g) for g in values)


def test_order_is_era_then_authority_then_counter() -> None:
    # authority is the high nibble of the raw id, so it outranks any counter within an era
    assert GDID(0, 1, 0) > GDID(0, 0, MAX_COUNTER)
    assert GDID(1, 0, 0) > GDID(0, 15, MAX_COUNTER)
    assert GDID(5, 3, 7) < GDID(5, 3, 8)


@given(eras, authorities, counters)
def test_hash_eq_consistent(era: int, authority: int, counter: int) -> None:
    a = GDID(era, authority, counter)
    b = GDID.parse(f"{era}:{authority}:{counter}")
    assert a == b and not (a != b)
    assert hash(a) == hash(b)
    assert len({a, b, GDID.from_bytes(bytes(a))}) == 1
    assert {a: 1}[b] == 1


@given(gdids, gdids)
def test_distinct_values_are_distinct_set_members(a: GDID, b: GDID) -> None:
    assume(a != b)
    assert len({a, b}) == 2


def test_not_equal_to_other_types() -> None:
    g = GDID(1, 2, 3)
    assert g != "1:2:3"
    assert g != (1, 2, 3)
    assert g != bytes(g)
    assert g is not None
    with pytest.raises(TypeError):
        _ = g < "1:2:3"  # type: ignore[operator]


def test_immutable() -> None:
    g = GDID(1, 2, 3)
    with pytest.raises(AttributeError):
        g.era = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        g._era = 5  # type: ignore[misc]
    assert g == GDID(1, 2, 3)


@given(gdids)
def test_pickle_and_copy_round_trip(g: GDID) -> None:
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(g, protocol=protocol))
        assert back == g and type(back) is GDID and hash(back) == hash(g)
    assert copy.copy(g) == g
    assert copy.deepcopy(g) == g


# -- refusals ----------------------------------------------------------------------------------------

NUMBER_POSITIONS = [0, 1, 2]


@given(gdids, st.sampled_from(NUMBER_POSITIONS), st.sampled_from(["+", "-"]), st.booleans())
def test_text_rejects_signs(g: GDID, position: int, sign: str, inner_space: bool) -> None:
    parts = [str(g.era), str(g.authority), str(g.counter)]
    parts[position] = sign + (" " if inner_space else "") + parts[position]
    assert_refused(":".join(parts))


@pytest.mark.parametrize(
    "text",
    [":0:1", "0::1", "0:0:", "::", " : : ", "0: :1", "", "   ", ":"],
)
def test_text_rejects_empty_parts(text: str) -> None:
    assert_refused(text)


@pytest.mark.parametrize(
    "text",
    [
        "\u0661:0:1",  # ARABIC-INDIC DIGIT ONE
        "0:\uff11:1",  # FULLWIDTH DIGIT ONE
        "0:0:\u00b2",  # SUPERSCRIPT TWO (str.isdigit() is true for it)
        "0:0:1\u0663",  # ascii followed by ARABIC-INDIC DIGIT THREE
        "\U0001d7ce:0:0",  # MATHEMATICAL BOLD DIGIT ZERO
        "0:0:\u0967",  # DEVANAGARI DIGIT ONE
    ],
)
def test_text_rejects_non_ascii_digits(text: str) -> None:
    assert_refused(text)


@pytest.mark.parametrize(
    "text",
    ["0x1:0:0", "1e3:0:0", "1.0:0:0", "1_000:0:0", "0:0:1 2", "a:0:0", "0:0:0x10", "0:0:1\x00", "0:0:١"],
)
def test_text_rejects_non_decimal_numbers(text: str) -> None:
    assert_refused(text)


@given(st.integers(16, 2**70))
def test_text_rejects_authority_above_15(authority: int) -> None:
    assert_refused(f"0:{authority}:0")


@given(st.integers(2**60, 2**80))
def test_text_rejects_counter_above_limit(counter: int) -> None:
    assert_refused(f"0:0:{counter}")


@given(st.integers(2**32, 2**80))
def test_text_rejects_era_above_limit(era: int) -> None:
    assert_refused(f"{era}:0:0")


def test_text_limits_are_inclusive() -> None:
    g = GDID.parse(f"{MAX_ERA}:15:{MAX_COUNTER}")
    assert (g.era, g.authority, g.counter) == (MAX_ERA, 15, MAX_COUNTER)
    assert g.hex == "f" * 24
    assert_refused(f"{MAX_ERA + 1}:0:0")
    assert_refused("0:16:0")
    assert_refused(f"0:0:{MAX_COUNTER + 1}")


@pytest.mark.parametrize("digits", [4301, 5000, 20000])
def test_text_with_absurdly_long_numbers_is_a_gdid_error(digits: int) -> None:
    # Python's int() refuses > 4300 digits with a plain ValueError; mdb must still raise GDIDError.
    assert_refused("0:0:" + "9" * digits)
    assert_refused("9" * digits + ":0:0")
    assert_refused("0:0:" + "0" * digits + "1" * 30)


def test_text_leading_zeros_do_not_hide_a_valid_value() -> None:
    assert GDID.parse("0:0:" + "0" * 5000 + "7") == GDID(0, 0, 7)


@pytest.mark.parametrize("text", ["1", "1:2", "1:2:3:4", "1:2:3:4:5", "1:2:3:", ":1:2:3"])
def test_text_rejects_wrong_part_counts(text: str) -> None:
    assert_refused(text)


@given(st.text(alphabet="0123456789abcdefABCDEF", max_size=40).filter(lambda s: len(s) != 24))
def test_hex_rejects_any_other_length(text: str) -> None:
    assert_refused(text)
    assert_refused("0x" + text)


@given(gdids, st.integers(0, 23), st.sampled_from(list("gGzZ-+.;é\u0660 _")))
def test_hex_rejects_non_hex_digits(g: GDID, position: int, bad: str) -> None:
    text = g.hex[:position] + bad + g.hex[position + 1 :]
    assert_refused(text)


@pytest.mark.parametrize(
    "text",
    [
        "0x0x" + "0" * 24,  # only one prefix
        "0x" + "0" * 23,
        "x" + "0" * 24,
        "00" * 6 + " " + "00" * 6,  # inner whitespace is not trimmed
        "0000050d 3000000000000039",
        "0000050d3000000000000039 0",
        "+0000050d3000000000000039",
        "-000050d3000000000000039",
        "0x-000050d3000000000000039",
        "0b" + "0" * 24,
        "0" * 25,
        "0" * 23,
        "0" * 48,
    ],
)
def test_hex_rejects_malformed(text: str) -> None:
    assert_refused(text)


def test_parse_rejects_non_text() -> None:
    for value in (b"0:0:1", 1, None, GDID(0, 0, 1).raw_id):
        with pytest.raises(GDIDError):
            GDID.parse(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "args",
    [(-1, 0, 0), (0, -1, 0), (0, 0, -1), (2**32, 0, 0), (0, 16, 0), (0, 0, 2**60), (1.0, 0, 0), ("1", 0, 0), (True, 0, 0), (0, False, 0)],
)
def test_constructor_validates(args: tuple[object, object, object]) -> None:
    with pytest.raises(GDIDError):
        GDID(*args)  # type: ignore[arg-type]


@given(st.binary(max_size=30).filter(lambda b: len(b) != 12))
def test_from_bytes_rejects_wrong_length(data: bytes) -> None:
    with pytest.raises(GDIDError):
        GDID.from_bytes(data)


# -- pydantic --------------------------------------------------------------------------------------------


class Owner(BaseModel):
    id: GDID
    parent: GDID | None = None


@given(gdids)
def test_pydantic_accepts_text_hex_and_instances(g: GDID) -> None:
    for value in (str(g), g.hex, g.hex.upper(), "0x" + g.hex, g):
        m = Owner(id=value)
        assert isinstance(m.id, GDID) and m.id == g


@given(gdids)
def test_pydantic_serializes_to_text(g: GDID) -> None:
    m = Owner(id=g, parent=g)
    assert m.model_dump(mode="json") == {"id": str(g), "parent": str(g)}
    back = Owner.model_validate_json(m.model_dump_json())
    assert back == m and back.id == g


def test_pydantic_none_and_errors() -> None:
    assert Owner(id="0:0:1").model_dump(mode="json") == {"id": "0:0:1", "parent": None}
    for bad in ("0:16:0", "zz", "", 5, b"0:0:1", 1.5, None):
        with pytest.raises(ValidationError):
            Owner(id=bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError) as info:
        Owner(id="0:+1:0")
    assert "'0:+1:0'" in str(info.value)


def test_pydantic_json_schema_is_a_string() -> None:
    schema = Owner.model_json_schema(mode="validation")
    assert schema["properties"]["id"]["type"] == "string"


# -- SQLAlchemy: the 12-byte column sorts like the ids -----------------------------------------------------

metadata = sa.MetaData()
things = sa.Table(
    "things",
    metadata,
    sa.Column("n", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("g", GDIDType(), nullable=True, index=True),
)

# A set of GDIDs that straddles every interesting boundary of the byte form.
EDGE_GDIDS = [
    GDID(0, 0, 1),
    GDID(0, 0, 255),
    GDID(0, 0, 256),
    GDID(0, 0, 2**59),
    GDID(0, 0, MAX_COUNTER),
    GDID(0, 1, 0),
    GDID(0, 7, MAX_COUNTER),
    GDID(0, 8, 0),  # raw id with the top bit set: a signed 64-bit integer would sort it first
    GDID(0, 15, MAX_COUNTER),
    GDID(1, 0, 0),
    GDID(2**31 - 1, 0, 0),
    GDID(2**31, 0, 0),  # era with the top bit set
    GDID(MAX_ERA, 15, MAX_COUNTER),
]

sql_gdid_lists = st.lists(nonzero_gdids | st.sampled_from(EDGE_GDIDS), min_size=1, max_size=25, unique=True)


def _check_order_and_round_trip(engine: sa.Engine, values: list[GDID]) -> None:
    with engine.begin() as conn:
        conn.execute(things.delete())
        conn.execute(things.insert(), [{"n": i, "g": g} for i, g in enumerate(values)])
    with engine.connect() as conn:
        ordered = conn.execute(sa.select(things.c.g).order_by(things.c.g)).scalars().all()
        assert ordered == sorted(values)
        assert all(type(g) is GDID for g in ordered)
        by_n = dict(conn.execute(sa.select(things.c.n, things.c.g)).all())
        assert by_n == dict(enumerate(values))
        # comparisons in SQL use the index order too: a range scan returns exactly the ids >= pivot
        pivot = values[len(values) // 2]
        above = conn.execute(sa.select(things.c.g).where(things.c.g >= pivot).order_by(things.c.g)).scalars().all()
        assert above == sorted(g for g in values if g >= pivot)
        # equality lookup by value
        assert conn.execute(sa.select(things.c.n).where(things.c.g == pivot)).scalar_one() == values.index(pivot)


def _check_none_and_text_binds(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(things.delete())
        conn.execute(things.insert(), [{"n": 1, "g": None}, {"n": 2, "g": "1293:3:57"}, {"n": 3, "g": "0000050d3000000000000040"}])
    with engine.connect() as conn:
        rows = dict(conn.execute(sa.select(things.c.n, things.c.g)).all())
        assert rows == {1: None, 2: GDID(1293, 3, 57), 3: GDID(1293, 3, 64)}
        raw = conn.execute(sa.select(sa.cast(things.c.g, sa.LargeBinary)).where(things.c.n == 2)).scalar_one()
        assert bytes(raw) == bytes.fromhex("0000050d3000000000000039")
    with pytest.raises(sa.exc.StatementError) as info, engine.begin() as conn:
        conn.execute(things.insert(), [{"n": 4, "g": "not-a-gdid"}])
    assert isinstance(info.value.orig, GDIDError)
    with pytest.raises(sa.exc.StatementError), engine.begin() as conn:
        conn.execute(things.insert(), [{"n": 5, "g": 12345}])


def _check_literal_binds(engine: sa.Engine) -> None:
    """A statement compiled with its GDIDs inlined (literal_binds) must find the same rows."""
    values = [GDID(1293, 3, 57), GDID(0, 8, 0), GDID(2**31, 0, 1)]
    with engine.begin() as conn:
        conn.execute(things.delete())
        conn.execute(things.insert(), [{"n": i, "g": g} for i, g in enumerate(values)])
    stmt = sa.select(things.c.n).where(things.c.g.in_([values[1], str(values[2])])).order_by(things.c.n)
    sql = str(stmt.compile(dialect=engine.dialect, compile_kwargs={"literal_binds": True}))
    assert values[1].hex in sql
    with engine.connect() as conn:
        assert conn.execute(stmt).scalars().all() == [1, 2]
        assert conn.exec_driver_sql(sql).scalars().all() == [1, 2]


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> sa.Engine:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'gdid.db'}")
    metadata.create_all(engine)
    yield engine
    engine.dispose()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=sql_gdid_lists)
def test_sqlite_index_order_equals_gdid_order(sqlite_engine: sa.Engine, values: list[GDID]) -> None:
    _check_order_and_round_trip(sqlite_engine, values)


def test_sqlite_edge_values_order(sqlite_engine: sa.Engine) -> None:
    _check_order_and_round_trip(sqlite_engine, list(reversed(EDGE_GDIDS)))


def test_sqlite_storage_is_a_12_byte_blob(sqlite_engine: sa.Engine) -> None:
    _check_none_and_text_binds(sqlite_engine)
    with sqlite_engine.connect() as conn:
        typ, length = conn.execute(sa.text("SELECT typeof(g), length(g) FROM things WHERE n = 2")).one()
        assert (typ, length) == ("blob", 12)
        # the index the column declares is really used for ORDER BY
        plan = " ".join(str(r) for r in conn.execute(sa.text("EXPLAIN QUERY PLAN SELECT g FROM things ORDER BY g")))
        assert "ix_things_g" in plan


def test_sqlite_literal_binds(sqlite_engine: sa.Engine) -> None:
    _check_literal_binds(sqlite_engine)


@pytest.fixture
def pg_engine(pg_url: str) -> sa.Engine:
    from mdb.urls import sqlalchemy_url

    engine = sa.create_engine(sqlalchemy_url(pg_url))
    metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.mark.postgres
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=sql_gdid_lists)
def test_postgres_index_order_equals_gdid_order(pg_engine: sa.Engine, values: list[GDID]) -> None:
    _check_order_and_round_trip(pg_engine, values)


@pytest.mark.postgres
def test_postgres_edge_values_and_storage(pg_engine: sa.Engine) -> None:
    _check_order_and_round_trip(pg_engine, list(reversed(EDGE_GDIDS)))
    _check_none_and_text_binds(pg_engine)
    _check_literal_binds(pg_engine)
    with pg_engine.connect() as conn:
        data_type = conn.execute(
            sa.text("SELECT data_type FROM information_schema.columns WHERE table_name = 'things' AND column_name = 'g'")
        ).scalar_one()
        assert data_type == "bytea"
        assert conn.execute(sa.text("SELECT octet_length(g) FROM things WHERE n = 2")).scalar_one() == 12
        # bytea compares bytewise regardless of the database collation
        conn.execute(sa.text("SET enable_seqscan = off"))
        plan = "\n".join(r[0] for r in conn.execute(sa.text("EXPLAIN SELECT g FROM things ORDER BY g")))
        assert "ix_things_g" in plan


@given(st.binary(min_size=12, max_size=12))
def test_any_twelve_bytes_are_a_gdid_equal_to_its_checked_construction(data: bytes) -> None:
    """from_bytes skips the field checks (any 12 bytes are in range): what it builds must be
    the value the checked constructor builds from the same parts, and round-trip."""
    g = GDID.from_bytes(data)
    era, raw = int.from_bytes(data[:4], "big"), int.from_bytes(data[4:], "big")
    checked = GDID(era, raw >> 60, raw & (2**60 - 1))
    assert g == checked and hash(g) == hash(checked) and str(g) == str(checked)
    assert bytes(g) == data and g.hex == data.hex()


def test_from_bytes_refuses_what_is_not_bytes() -> None:
    for value in (12, "0" * 12, None):
        with pytest.raises(TypeError):
            GDID.from_bytes(value)  # type: ignore[arg-type]
