"""Masking of secrets in connection URLs.

Every place that shows a URL to a person (repr, logs, errors, CLI output) goes through
:func:`mask_url`, so a password never leaves the process in text. Masking never depends on the
URL being valid: a URL with an empty or misspelled scheme (``://u:pw@h/db``), or none at all
(``u:pw@h``), is masked like a good one, because those are exactly the URLs that end up in
error messages.
"""

from __future__ import annotations

import re

__all__ = ["mask_url", "mask_secrets"]

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
