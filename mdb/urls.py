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


def mask_url(url: str) -> str:
    """Replace the password of ``scheme://user:password@host`` (and password query args) with ***."""
    masked = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", url)
    return _QUERY.sub(lambda m: f"{m['head']}{MASK}", masked)


def mask_secrets(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """Mask URLs inside free text (e.g. a driver's error message) and any known secret values."""
    masked = mask_url(text)
    for secret in secrets:
        if secret:
            masked = masked.replace(secret, MASK)
    return masked
