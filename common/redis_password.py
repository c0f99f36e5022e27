"""The Redis registry's password: in ``registry.redis_url`` (``redis://:pw@host`` or, as
redis-py reads too, ``?password=pw``), or in ``PDSERVE_REDIS_PASSWORD``.

Rendered deployments never write it into their files (a ConfigMap or a compose file is
read by whoever may read the deployment): they keep the URL without it and give every
container the variable, from the Secret ``pdserve-redis`` (key ``password``) on
Kubernetes, from the host's environment under compose. Logs show the URL redacted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import parse_qsl, unquote_plus, urlsplit

REDIS_PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
REDIS_PASSWORD_SECRET = "pdserve-redis"  # Kubernetes: its key "password"
_QUERY_KEY = "password"


def url_password(url: str) -> str | None:
    """The password ``url`` holds, before its host or in its query (None without one)."""
    parts = urlsplit(url)
    if parts.password is not None:
        return parts.password
    query = [value for key, value in parse_qsl(parts.query) if key == _QUERY_KEY]
    return query[0] if query else None


def without_password(url: str, mask: str = "") -> str:
    """``url`` without its password, wherever it is (``mask`` in its place, when given:
    for what is printed or logged). A password in the query was kept: rendered files,
    ``config check`` and error lines showed it (a security audit).

    By hand, not through urlsplit: a "/" in the password ends urlsplit's host part early,
    so a URL the config refuses would show it; and urlunsplit writes "unix://:pw@/path"
    without its password as "unix:/path", which redis-py refuses. Everything but the
    password stays as written."""
    scheme, separator, rest = url.partition("://")
    head, mark, query = rest.partition("?")
    userinfo, at, address = head.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.partition(":")[0]
        secret = f":{mask}" if mask else ""
        head = f"{user}{secret}@{address}" if user or secret else address
    pairs = query.split("&") if mark else []
    kept = [f"{_QUERY_KEY}={mask}" if _is_password(pair) else pair
            for pair in pairs if mask or not _is_password(pair)]  # fmt: skip
    return f"{scheme}{separator}{head}{'?' if kept else ''}{'&'.join(kept)}"


def _is_password(pair: str) -> bool:
    """Whether a query pair is the password's, its key read as redis-py reads it
    (percent-decoded, "+" a space): ``passw%6Frd=...`` was written into rendered files."""
    return unquote_plus(pair.partition("=")[0]) == _QUERY_KEY


def password_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """``PDSERVE_REDIS_PASSWORD`` (None when unset or empty): it outranks the URL's."""
    return environ.get(REDIS_PASSWORD_ENV) or None
