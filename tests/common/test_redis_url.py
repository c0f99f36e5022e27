"""``registry.redis_url`` is checked as redis-py reads it, and its error never shows the
password: not before the host, not in the query, not where the URL does not parse."""

from __future__ import annotations

import pytest

from common.config import RegistryConfig
from common.config_base import ConfigError
from common.redis_password import without_password
from common.redis_url import redis_url_problem

GOOD = [
    "redis://127.0.0.1:6379/0",
    "redis://redis.internal",
    "rediss://u:pw@redis.internal:6380/3",
    "redis://[::1]:6379/0",
    "redis://r:6379/0?db=1",
    "unix:///run/redis.sock?db=1",
    "unix://:pw@/run/redis.sock",
]


@pytest.mark.parametrize("url", GOOD)
def test_urls_redis_py_reads_as_written_pass(url):
    assert redis_url_problem(url) is None
    assert RegistryConfig(redis_url=url).redis_url == url


@pytest.mark.parametrize(
    "url",
    [
        "redis://:S3CRET@r:port/0",  # a port that is no number
        "redis://u:S3CRET@::1:6379/0",  # IPv6 without brackets
        "redis://u:S3CRET@[::1:6379/0",  # does not parse at all
        "redis://:S3/CRET@r:6379/0",  # an unescaped "/": urlsplit's host ends at it
        "redis://:S3CRET@/0",  # no host
        "redis://r/x?password=S3CRET",  # a database that is no number
        "http://u:S3CRET@r/0?password=S3CRET",
    ],
)
def test_a_refused_url_never_shows_its_password(url):
    with pytest.raises(ConfigError) as refused:
        RegistryConfig(redis_url=url)
    assert refused.value.key == "registry.redis_url"
    assert "S3" not in str(refused.value) and "CRET" not in str(refused.value), refused.value
    assert "***" in str(refused.value)


def test_the_shown_url_keeps_all_but_the_password():
    def shown(url: str) -> str:
        return without_password(url, mask="***")

    assert shown("redis://u:pw@r:6379/0?db=1") == "redis://u:***@r:6379/0?db=1"
    assert shown("unix:///run/r.sock?password=pw&db=1") == "unix:///run/r.sock?password=***&db=1"
    assert shown("redis://r:6379/0") == "redis://r:6379/0"
    assert shown("redis://:pw/x@r:6379/0") == "redis://:***@r:6379/0"  # "/" in it: by hand
    assert shown("redis://u@r/0?db=1&password=a%26b") == "redis://u@r/0?db=1&password=***"
    # Without a mask, the password goes and everything else stays as written.
    assert without_password("redis://:pw@r/0?a=%2F&password=x&b=1") == "redis://r/0?a=%2F&b=1"
    assert without_password("redis://u:pw@r/0?password=x") == "redis://u@r/0"
