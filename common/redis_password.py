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
from urllib.parse import parse_qsl, urlencode, urlsplit

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
    ``config check`` and error lines showed it (a security audit)."""
    # By hand: urlunsplit writes "unix://:pw@/path" without its password as "unix:/path",
    # which redis-py refuses.
    parts = urlsplit(url)
    if parts.password is not None:
        user = parts.username or ""
        secret = f":{mask}" if mask else ""
        host = parts.netloc.rpartition("@")[2]
        netloc = f"{user}{secret}@{host}" if user or secret else host
        start = len(parts.scheme) + 3  # past "scheme://"
        url = url[:start] + netloc + url[start + len(parts.netloc) :]
    base, mark, rest = url.partition("?")
    query, hash_mark, fragment = rest.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    if not mark or all(key != _QUERY_KEY for key, _ in pairs):
        return url
    kept = [(key, mask if key == _QUERY_KEY else value)
            for key, value in pairs if mask or key != _QUERY_KEY]  # fmt: skip
    query = urlencode(kept, safe="*")
    return f"{base}{'?' if query else ''}{query}{hash_mark}{fragment}"


def password_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """``PDSERVE_REDIS_PASSWORD`` (None when unset or empty): it outranks the URL's."""
    return environ.get(REDIS_PASSWORD_ENV) or None
