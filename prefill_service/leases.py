"""Leases: how long a prefill worker keeps a finished prompt's KV for its decode worker.

A lease ends in exactly one way: released (the decode side reported the pull done through
the connector, or the router called ReleaseKV) or expired (nobody pulled in time). Either
way the blocks go back to the engine. Owned by the engine thread.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    request_id: str
    expires_at: float  # time.monotonic()
    expires_at_unix: float


class LeaseTable:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._leases: dict[str, Lease] = {}
        self._by_request: dict[str, str] = {}  # request_id -> lease_id
        self.num_released = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, request_id: str) -> Lease:
        lease = Lease(
            lease_id=f"lease-{uuid.uuid4().hex}",
            request_id=request_id,
            expires_at=time.monotonic() + self.lease_s,
            expires_at_unix=time.time() + self.lease_s,
        )
        self._leases[lease.lease_id] = lease
        self._by_request[request_id] = lease.lease_id
        return lease

    def release(self, lease_id: str) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            del self._by_request[lease.request_id]
            self.num_released += 1
        return lease

    def release_request(self, request_id: str) -> Lease | None:
        """Release the lease granted to ``request_id``, if it holds one."""
        lease_id = self._by_request.get(request_id)
        return None if lease_id is None else self.release(lease_id)

    def pop_expired(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            del self._leases[lease.lease_id]
            del self._by_request[lease.request_id]
        self.num_expired += len(expired)
        return expired
