"""Connection URLs: what kind of server one names, and masking the secrets in it.

Every place that shows a URL to a person (repr, logs, errors, CLI output) goes through
:func:`mask_url`, so a password never leaves the process in text. Masking never depends on the
URL being valid: a URL with an empty or misspelled scheme (``://u:pw@h/db``), or none at all
(``u:pw@h``), is masked like a good one, because those are exactly the URLs that end up in
error messages.
"""

from __future__ import annotations

import re
from typing import Final

from sqlalchemy.engine import URL, make_url

from mdb.dialects import find_sql_dialect

__all__ = ["MONGO", "SQL", "kind_of_url", "mask_secrets", "mask_url", "register_kind", "sqlalchemy_url"]

# -- server kinds ------------------------------------------------------------------------------
# Every server of a map is of one kind (``sql``: PostgreSQL or SQLite through SQLAlchemy; ``mongo``:
# MongoDB through pymongo), and the kind picks the backend that implements the server-side half
# of every feature (:mod:`mdb.backends`). This is the one place that reads a URL's scheme: code
# asks :func:`kind_of_url` (or ``PartitionMap.kind_of``), never tests a scheme or dialect itself.

SQL: Final = "sql"
MONGO: Final = "mongo"

_SCHEMES: dict[str, str] = {"mongodb": MONGO, "mongodb+srv": MONGO}
"""URL scheme -> kind, for every kind but SQL; any other scheme is a SQLAlchemy URL."""


def register_kind(scheme: str, kind: str) -> None:
    """Route URLs of ``scheme`` (e.g. ``mongodb``, without ``://``) to the backend of ``kind``."""
    known = _SCHEMES.get(scheme.lower())
    if known is not None and known != kind:
        raise ValueError(f"URL scheme {scheme!r} is already served by kind {known!r}")
    _SCHEMES[scheme.lower()] = kind


def kind_of_url(url: str) -> str:
    """The kind of server ``url`` names, by the text before ``://`` (SQL unless registered)."""
    scheme, sep, _ = url.strip().partition("://")
    return _SCHEMES.get(scheme.lower(), SQL) if sep else SQL


def sqlalchemy_url(url: str) -> URL:
    """Parse a SQL server's map URL, choosing psycopg 3 for bare ``postgresql://`` URLs."""
    parsed = make_url(url)
    dialect = find_sql_dialect(parsed)
    return parsed if dialect is None else dialect.normalise_url(parsed)


# -- masking -----------------------------------------------------------------------------------

# In free text a URL is recognised by its "://"; the scheme before it may be missing or misspelled.
_USERINFO = re.compile(r"(?P<head>(?:[a-zA-Z][a-zA-Z0-9+.\-]*)?://[^:/@\s]*):(?P<secret>[^@\s]*)@")
_QUERY = re.compile(r"(?P<head>[?&](?:password|passwd|pwd|secret|token)=)(?P<secret>[^&\s]*)", re.I)
MASK = "***"


# One whole URL: after the first "://" (or from the start when there is none), the user runs
# to the first ':' and the password to the next '@', even across spaces and '@' in the user,
# as SQLAlchemy parses it (``postgresql://u:correct horse@h/db`` connects with the password
# "correct horse"); no scheme is required.
_SCHEME_END = "://"
_WHOLE_USERINFO = re.compile(r"(?P<user>[^:/]*):(?P<secret>[^@]*)@")
_WHOLE_QUERY = re.compile(r"(?P<head>[?&](?:password|passwd|pwd|secret|token)=)(?P<secret>[^&#]*)", re.I)


def _mask_embedded(text: str) -> str:
    masked = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)
    return _QUERY.sub(lambda m: f"{m['head']}{MASK}", masked)


def mask_url(url: str) -> str:
    """Replace the password of ``scheme://user:password@host`` (and password query args) with ***."""
    scheme_end = url.find(_SCHEME_END)
    start = 0 if scheme_end < 0 else scheme_end + len(_SCHEME_END)
    m = _WHOLE_USERINFO.match(url, start)
    masked = url if m is None else f"{url[:start]}{m['user']}:{MASK}@{url[m.end():]}"
    masked = _WHOLE_QUERY.sub(lambda m: f"{m['head']}{MASK}", masked)
    return _mask_embedded(masked)


def mask_secrets(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """Mask URLs inside free text (e.g. a driver's error message) and any known secret values."""
    masked = _mask_embedded(text)
    for secret in secrets:
        if secret:
            masked = masked.replace(secret, MASK)
    return masked
