"""Masking of secret-looking values before anything leaves the agent (pure)."""

from __future__ import annotations

import re

SECRET_KEY = re.compile(r"(token|passw(or)?d|secret|credential|api[_.-]?key|(^|[_.-])key$|auth)", re.I)
MASK = "***"


def is_secret_key(key: str) -> bool:
    return bool(SECRET_KEY.search(key))


def mask_value(key: str, value: str) -> str:
    return MASK if is_secret_key(key) else value


def mask_url(url: str) -> str:
    """``scheme://user:pass@host`` -> ``scheme://user:***@host``."""
    return re.sub(r"(//[^/:@]*:)[^@/]*@", r"\1" + MASK + "@", url)
