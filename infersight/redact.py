"""Masking of secret-looking values before anything leaves the agent (pure)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import SplitResult, urlsplit

SECRET_KEY = re.compile(r"(token|passw(or)?d|secret|credential|api[_.-]?key|(^|[_.-])key$|auth)", re.I)
MASK = "***"


def is_secret_key(key: str) -> bool:
    return bool(SECRET_KEY.search(key))


def mask_value(key: str, value: str) -> str:
    return MASK if is_secret_key(key) else value


def _mask_query(query: str) -> str:
    """``a=1&token=x`` -> ``a=1&token=***``: values of secret-looking parameters."""
    parts = []
    for part in query.split("&"):
        name, eq, _ = part.partition("=")
        parts.append(name + eq + MASK if eq and is_secret_key(name) else part)
    return "&".join(parts)


def mask_url(url: str) -> str:
    """``scheme://user:pass@host`` -> ``scheme://user:***@host``, and secret-looking query values.

    The password is found through ``urllib.parse``'s parsed userinfo, so an escaped
    ``%40`` or ``%2F`` in it is masked whole. A password holding a raw ``/``, ``?`` or
    ``#`` makes the URL parse with its ``@`` in the path: then everything between
    ``//`` and the last ``@`` is masked, user name included (better hide too much).
    """
    try:
        u = urlsplit(url)
        _ = u.port  # a bad port is no reason to show the rest
    except ValueError:
        u = None
    if u is None or "@" in u.path + u.query + u.fragment:
        return _mask_unparsed(url)
    netloc = u.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = user + (":" + MASK if colon else "") + "@" + hostport
    return SplitResult(u.scheme, netloc, u.path, _mask_query(u.query), u.fragment).geturl() if (
        netloc != u.netloc or u.query
    ) else url


def _mask_unparsed(url: str) -> str:
    scheme, sep, rest = url.partition("//")
    if not sep:
        scheme, rest = "", url
    _, _, host = rest.rpartition("@")
    return scheme + sep + MASK + "@" + host.split("?", 1)[0]


def _password_fragments(url: str) -> list[str]:
    """Pieces of everything that may be a password in ``url`` (between the first ':'
    after '//' and the last '@'), split where a parser would split them."""
    rest = url.partition("//")[2] if "//" in url else url
    userinfo = rest.rpartition("@")[0]
    secret = userinfo.partition(":")[2]
    return [f for f in re.split(r"[/?#@:]", secret) if len(f) >= 2]


def scrub(text: str, value: str) -> str:
    """``text`` (a parser's message about ``value``) with ``value`` masked; withheld
    entirely when it still quotes a piece of the value's password."""
    text = text.replace(value, mask_url(value)) if value else text
    if any(f in text for f in _password_fragments(value)):
        return "the parser's message is withheld: it quotes part of the password"
    return text


def shown_value(key: str, value: Any) -> str:
    """How a configuration value may appear in an error message: never a secret, and a
    URL only with its password masked."""
    if is_secret_key(key):
        return MASK
    if isinstance(value, str) and ("@" in value or "://" in value):
        return repr(mask_url(value))
    return repr(value)
