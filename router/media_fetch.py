"""Images from http(s) URLs, from the hosts an operator allows and no others.

A server that fetches URLs its clients name can be pointed at its own private network
(server-side request forgery): metadata services, admin ports, other tenants' services.
So nothing is fetched unless ``router.allowed_media_domains`` names the URL's host
exactly (as vLLM's ``--allowed-media-domains``); redirects are not followed (one could
lead anywhere); a reply is read only up to the request's image budget, and within
``router.media_fetch_timeout_s``. Every failure is the request's: a 400 naming the part.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from router.errors import APIError, bad_request


class MediaFetcher:
    def __init__(self, allowed_domains: list[str], timeout_s: float) -> None:
        self.allowed_domains = frozenset(domain.lower() for domain in allowed_domains)
        self.timeout_s = timeout_s

    def check(self, url: str, param: str) -> None:
        """Raise a 400 unless ``url`` is http(s) on an allowed host."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise bad_request(
                f"an image URL must be data:, http: or https:, got {parts.scheme or url!r}:",
                param,
            )
        host = (parts.hostname or "").lower()
        if host not in self.allowed_domains:
            allowed = ", ".join(sorted(self.allowed_domains)) or "none"
            raise bad_request(
                f"images are fetched only from router.allowed_media_domains ({allowed}); "
                f"{host!r} is not one (or send the image inline as a data: URL)",
                param,
            )

    async def fetch(self, client: httpx.AsyncClient, url: str, param: str, max_bytes: int) -> bytes:
        """The body of ``url`` (``check`` it first), at most ``max_bytes``."""
        try:
            async with client.stream("GET", url) as reply:
                if reply.is_redirect:
                    raise bad_request(f"fetching the image was redirected ({reply.status_code}); "
                                      "redirects are not followed", param)  # fmt: skip
                if reply.status_code != 200:
                    raise bad_request(f"fetching the image answered HTTP {reply.status_code}",
                                      param)  # fmt: skip
                chunks, size = [], 0
                async for chunk in reply.aiter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise bad_request(f"the image is larger than the request's {max_bytes} "
                                          "bytes left for images (router.max_request_bytes)",
                                          param)  # fmt: skip
                    chunks.append(chunk)
        except APIError:
            raise
        except httpx.TimeoutException:
            raise bad_request(f"fetching the image took over {self.timeout_s:g} s "
                              "(router.media_fetch_timeout_s)", param) from None  # fmt: skip
        except httpx.HTTPError as exc:
            raise bad_request(f"could not fetch the image: {exc}", param) from None
        if not chunks:
            raise bad_request("the image URL's body is empty", param)
        return b"".join(chunks)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False)
