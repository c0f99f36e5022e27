"""Images from http(s) URLs, from the hosts an operator allows and no others.

A server that fetches URLs its clients name can be pointed at its own private network
(server-side request forgery): metadata services, admin ports, other tenants' services.
So nothing is fetched unless ``router.allowed_media_domains`` names the URL's host
exactly (as vLLM's ``--allowed-media-domains``); redirects are not followed (one could
lead anywhere); the replies are read only up to the request's image budget (shared by
its fetches, which run at once), and each whole fetch within
``router.media_fetch_timeout_s`` (httpx's timeout bounds each read: a host sending a byte
a second held a fetch for as long as it liked). Every failure is the request's: a 400
naming the part.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx

from router.errors import APIError, bad_request


class ImageBudget:
    """The bytes a request's images may still take, shared by its fetches as they read
    (each was given all that was left, so eight at once could hold eight budgets)."""

    def __init__(self, num_bytes: int) -> None:
        self.total = self.left = num_bytes

    def take(self, num_bytes: int, param: str) -> None:
        self.left -= num_bytes
        if self.left < 0:
            raise bad_request(f"the request's images are larger than the {self.total} bytes "
                              "a request may hold (router.max_request_bytes)", param)  # fmt: skip


class MediaFetcher:
    def __init__(self, allowed_domains: list[str], timeout_s: float) -> None:
        self.allowed_domains = frozenset(domain.lower() for domain in allowed_domains)
        self.timeout_s = timeout_s

    def check(self, url: str, param: str) -> None:
        """Raise a 400 unless ``url`` is http(s) on an allowed host."""
        if any(ch.isspace() or not ch.isprintable() for ch in url):
            # (urlsplit drops tabs and newlines that httpx then refuses: a 500 before)
            raise bad_request("an image URL must not hold spaces or control characters", param)
        try:
            parts = urlsplit(url)
            hostname = parts.hostname
            parts.port  # noqa: B018 (raises for a port that is not a number)
        except ValueError as exc:
            raise bad_request(f"the image URL is not valid: {exc}", param) from None
        if parts.scheme not in ("http", "https"):
            raise bad_request(
                f"an image URL must be data:, http: or https:, got {parts.scheme or url!r}:",
                param,
            )
        host = (hostname or "").lower()
        if host not in self.allowed_domains:
            allowed = ", ".join(sorted(self.allowed_domains)) or "none"
            raise bad_request(
                f"images are fetched only from router.allowed_media_domains ({allowed}); "
                f"{host!r} is not one (or send the image inline as a data: URL)",
                param,
            )

    async def fetch(
        self, client: httpx.AsyncClient, url: str, param: str, budget: ImageBudget
    ) -> bytes:
        """The body of ``url`` (``check`` it first), taken from ``budget`` as it is read,
        within ``timeout_s`` in all."""
        try:
            async with asyncio.timeout(self.timeout_s), client.stream("GET", url) as reply:
                if reply.is_redirect:
                    raise bad_request(f"fetching the image was redirected ({reply.status_code}); "
                                      "redirects are not followed", param)  # fmt: skip
                if reply.status_code != 200:
                    raise bad_request(f"fetching the image answered HTTP {reply.status_code}",
                                      param)  # fmt: skip
                chunks = []
                async for chunk in reply.aiter_bytes():
                    budget.take(len(chunk), param)
                    chunks.append(chunk)
        except APIError:
            raise
        except (httpx.TimeoutException, TimeoutError):
            raise bad_request(f"fetching the image took over {self.timeout_s:g} s "
                              "(router.media_fetch_timeout_s)", param) from None  # fmt: skip
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise bad_request(f"could not fetch the image: {exc}", param) from None
        if not chunks:
            raise bad_request("the image URL's body is empty", param)
        return b"".join(chunks)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False)
