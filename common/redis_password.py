"""The Redis registry's password: in ``registry.redis_url``, or in ``PDSERVE_REDIS_PASSWORD``.

Rendered deployments never write it into their files (a ConfigMap or a compose file is
read by whoever may read the deployment): they keep the URL without it and give every
container the variable, from the Secret ``pdserve-redis`` (key ``password``) on
Kubernetes, from the host's environment under compose. Logs show the URL redacted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

REDIS_PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
REDIS_PASSWORD_SECRET = "pdserve-redis"  # Kubernetes: its key "password"


def url_password(url: str) -> str | None:
    """The password ``url`` holds (None without one)."""
    return urlsplit(url).password


def without_password(url: str, mask: str = "") -> str:
    """``url`` without its password (``mask`` in its place, when given: for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    secret = f":{mask}" if mask else ""
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{user}{secret}@{host}" if user or secret else host
    return urlunsplit(parts._replace(netloc=netloc))


def password_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """``PDSERVE_REDIS_PASSWORD`` (None when unset or empty): it outranks the URL's."""
    return environ.get(REDIS_PASSWORD_ENV) or None
