"""What ``registry.redis_url`` must be for redis-py to connect where it says.

``Redis.from_url`` checks little itself: a URL without a host, or with port 0, reaches
localhost:6379, and a database path that is no number is database 0, without a word.
So the config refuses them, naming the key, with the password masked (errors are printed
and logged).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from common.redis_password import without_password

_SCHEMES = ("redis", "rediss", "unix")
_EXAMPLE = "redis://host:6379/0"


def redis_url_problem(url: str) -> str | None:
    """None for a URL redis-py connects by as written, else the reason, starting with the
    URL (its password masked)."""
    problem = _problem(url)
    return None if problem is None else f"{without_password(url, mask='***')!r} {problem}"


def _problem(url: str) -> str | None:
    scheme, separator, _ = url.partition("://")
    if not separator or scheme not in _SCHEMES:  # (redis-py reads lower-case schemes only)
        return f"is not a Redis URL ({', '.join(s + '://' for s in _SCHEMES)}...)"
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed "["
        return "has a host that is no IPv6 address in brackets (redis://[::1]:6379/0)"
    try:
        port = parts.port
    except ValueError:
        address = parts.netloc.rpartition("@")[2]
        if address.count(":") > 1 and not address.startswith("["):
            return "has an IPv6 address without brackets (redis://[::1]:6379/0)"
        return "has a port that is no number in 1-65535"
    if scheme == "unix":
        return None if parts.path else "names no socket path (unix:///path/to/redis.sock)"
    if not parts.hostname:
        return f"names no host ({_EXAMPLE})"
    if port == 0:
        return "has port 0 (1-65535; redis-py would take 0 for 6379)"
    database = parts.path.removeprefix("/")
    if database and not database.isdigit():
        return f"has database {database!r}: the path is the database's number ({_EXAMPLE})"
    return None
