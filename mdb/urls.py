"""Masking of secrets in connection URLs.

Every place that shows a URL to a person (repr, logs, errors, CLI output) goes through
:func:`mask_url`, so a password never leaves the process in text.
"""

from __future__ import annotations

import re

__all__ = ["mask_url", "mask_secrets"]

_USERINFO = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/@\s]*):(?P<secret>[^@\s]*)@")
_QUERY = re.compile(r"(?P<head>[?&](?:password|passwd|pwd|secret|token)=)(?P<secret>[^&\s]*)", re.I)
MASK = "***"


# One whole URL: the password runs to the '@' even across spaces, as SQLAlchemy parses it
# (``postgresql://u:correct horse@h/db`` connects with the password "correct horse").
_WHOLE_USERINFO = re.compile(r"^(?P<head>\s*[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/@\s]*):(?P<secret>[^@]*)@")
_WHOLE_QUERY = re.compile(r"(?P<head>[?&](?:password|passwd|pwd|secret|token)=)(?P<secret>[^&#]*)", re.I)


def _mask_embedded(text: str) -> str:
    masked = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)
    return _QUERY.sub(lambda m: f"{m['head']}{MASK}", masked)


def mask_url(url: str) -> str:
    """Replace the password of ``scheme://user:password@host`` (and password query args) with ***."""
    masked = _WHOLE_USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", url, count=1)
    masked = _WHOLE_QUERY.sub(lambda m: f"{m['head']}{MASK}", masked)
    return _mask_embedded(masked)


def mask_secrets(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """Mask URLs inside free text (e.g. a driver's error message) and any known secret values."""
    masked = _mask_embedded(text)
    for secret in secrets:
        if secret:
            masked = masked.replace(secret, MASK)
    return masked
