"""Masking of secrets in connection URLs (docs/design.md invariant 6: secrets stay secret)."""

from __future__ import annotations

import string

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from sqlalchemy.engine import make_url

from mdb import mask_url
from mdb.urls import MASK, mask_secrets


@pytest.mark.parametrize(
    "url, masked",
    [
        ("postgresql+psycopg://u:p@h/db", "postgresql+psycopg://u:***@h/db"),
        ("postgresql://mdb:s3cret@10.0.0.5:5432/central_a", "postgresql://mdb:***@10.0.0.5:5432/central_a"),
        ("mongodb://u:p@h1,h2/db?authSource=x", "mongodb://u:***@h1,h2/db?authSource=x"),
        ("mongodb://u:p@h1:27017,h2:27018/db?replicaSet=rs&authSource=admin", "mongodb://u:***@h1:27017,h2:27018/db?replicaSet=rs&authSource=admin"),
        ("mongodb+srv://app:pw@cluster0.example.net/db", "mongodb+srv://app:***@cluster0.example.net/db"),
        ("postgresql://u:p@[::1]:5432/db", "postgresql://u:***@[::1]:5432/db"),
        ("postgresql://:onlypw@h/db", "postgresql://:***@h/db"),
        ("postgresql://u:pa%40ss%2Fw@h/db", "postgresql://u:***@h/db"),  # percent-encoded
        ("postgresql://u:pa/ss:w?rd#x@h/db", "postgresql://u:***@h/db"),  # raw specials SQLAlchemy accepts
        ("postgresql://u@h/db?password=p", "postgresql://u@h/db?password=***"),
        ("postgresql://u@h/db?sslmode=require&password=p&x=1", "postgresql://u@h/db?sslmode=require&password=***&x=1"),
        ("postgresql://u@h/db?PASSWORD=p", "postgresql://u@h/db?PASSWORD=***"),
        ("mysql://u@h/db?passwd=p&pwd=q", "mysql://u@h/db?passwd=***&pwd=***"),
        ("https://api.example.com/x?token=abc&secret=def", "https://api.example.com/x?token=***&secret=***"),
        ("postgresql://u:p@h/db?password=q", "postgresql://u:***@h/db?password=***"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    assert mask_url(masked) == masked  # idempotent


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://mdb@10.0.0.6/user_1",
        "postgresql://10.0.0.6:5432/user_1",
        "postgresql://u@h:5432/db",
        "postgresql://u@[::1]:5432/db",
        "postgresql://[::1]:5432/db",
        "sqlite:///mdb-data/user-2.db",
        "sqlite:////abs/path/x.db",
        "sqlite://",
        "sqlite:///:memory:",
        "mongodb://h1:27017,h2:27017/db?replicaSet=rs",
        "mongodb://u@h/db?authSource=admin&authMechanism=MONGODB-X509",
        "postgresql://u@h/db?sslmode=require&application_name=mdb",
        "postgresql://u@h/db?passwordless=1",
        "",
    ],
)
def test_urls_without_password_are_unchanged(url: str) -> None:
    assert mask_url(url) == url


def test_password_with_whitespace_is_masked() -> None:
    # SQLAlchemy accepts this URL and connects with the password "correct horse"
    url = "postgresql+psycopg://mdb:correct horse@10.0.0.5/central"
    assert make_url(url).password == "correct horse"
    masked = mask_url(url)
    assert "correct" not in masked and "horse" not in masked
    assert masked == "postgresql+psycopg://mdb:***@10.0.0.5/central"
    assert "horse" not in mask_url("postgresql://u@h/db?password=correct horse&x=1")


PW_ALPHABET = string.ascii_letters + string.digits + "!$&'()*+,;=-._~%:/?#[] "


@given(
    st.sampled_from(["postgresql", "postgresql+psycopg", "postgres", "mongodb", "mysql+pymysql"]),
    st.text(alphabet=string.ascii_lowercase + string.digits + "_-.", min_size=1, max_size=10),
    st.text(alphabet=PW_ALPHABET, min_size=8, max_size=30),
    st.sampled_from(["h", "10.0.0.5:5432", "h1,h2:27018", "[::1]:5432", "db.example.com"]),
    st.sampled_from(["", "/db", "/db?sslmode=require", "/db?authSource=admin&replicaSet=rs"]),
)
def test_masked_url_never_contains_the_password(scheme: str, user: str, password: str, host: str, tail: str) -> None:
    url = f"{scheme}://{user}:{password}@{host}{tail}"
    assume(password.strip() and password not in f"{scheme}://{user}:@{host}{tail}")
    masked = mask_url(url)
    assert password not in masked
    assert masked == f"{scheme}://{user}:{MASK}@{host}{tail}"


def test_mask_secrets_in_free_text() -> None:
    text = (
        "could not connect to postgresql://mdb:s3cret@10.0.0.5/central (password s3cret rejected); "
        "replica mongodb://ro:other@h1,h2/db?authSource=x is fine"
    )
    masked = mask_secrets(text, ["s3cret", ""])
    assert "s3cret" not in masked and "other" not in masked
    assert "postgresql://mdb:***@10.0.0.5/central" in masked
    assert "mongodb://ro:***@h1,h2/db?authSource=x" in masked
    assert "replica" in masked and "is fine" in masked  # the words around the URLs survive


def test_mask_secrets_leaves_plain_text_alone() -> None:
    text = "unknown area 'orders' (map version 3 has: user, archive); mail ops@example.com"
    assert mask_secrets(text) == text


@pytest.mark.parametrize(
    "url, masked",
    [
        ("://postgres:hunter2@127.0.0.1:2/x", "://postgres:***@127.0.0.1:2/x"),  # empty scheme (issue 11, item 14)
        ("postgresq l://postgres:hunter2@h/x", "postgresq l://postgres:***@h/x"),  # not a scheme SQLAlchemy parses
        ("postgres:hunter2@h/x", "postgres:***@h/x"),  # no scheme at all
        ("  postgresql://u:hunter2@h/x", "  postgresql://u:***@h/x"),
        ("postgresql://u@corp:hunter2@h/x", "postgresql://u@corp:***@h/x"),  # SQLAlchemy's user may hold an '@'
    ],
)
def test_mask_url_does_not_depend_on_parsing(url: str, masked: str) -> None:
    assert mask_url(url) == masked and "hunter2" not in mask_url(url)


def test_mask_secrets_masks_a_url_with_an_empty_scheme_in_free_text() -> None:
    text = "server 'c': '://postgres:hunter2@127.0.0.1:2/x' is not a database URL"
    assert mask_secrets(text) == "server 'c': '://postgres:***@127.0.0.1:2/x' is not a database URL"
