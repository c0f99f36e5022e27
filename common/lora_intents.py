"""The LoRA adapters loaded and unloaded at runtime, as every router sharing a worker pool
wants them: one ``LoraIntent`` per adapter name, kept in the registry
(``common/registry.py``) so that each router's reconcile brings the workers to the same
state, whichever router the load or unload went through.

The states, and why each exists:

- ``LOADED``: every available worker keeps it; a worker that lacks it (it joined, or
  restarted: a runtime load does not survive that) gets it from any router.
- ``RETIRING``: being unloaded through one router. No router admits new requests of it;
  the workers still serve it while the requests in flight finish.
- ``UNLOADED``: a tombstone, kept off every worker. Without it a router that once saw the
  adapter loaded (or a late one) would load it again.

``seq`` orders the writes: the registry gives each write the next number of one counter,
in the same transaction as the write, so a larger ``seq`` is always the later intent.
"""

from __future__ import annotations

import enum
import threading
from typing import Protocol

import msgspec


class LoraIntentState(enum.Enum):
    LOADED = "loaded"
    RETIRING = "retiring"
    UNLOADED = "unloaded"


class LoraIntent(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    path: str  # the adapter's directory, as the workers see it
    fingerprint: str  # of the files every worker loaded (``common.hashing.lora_key``)
    state: LoraIntentState
    seq: int = 0  # given by the store at each write; 0: not written yet

    @property
    def loaded(self) -> bool:
        return self.state is LoraIntentState.LOADED


def encode_intent(intent: LoraIntent) -> bytes:
    return msgspec.json.encode(intent)


def decode_intent(raw: str | bytes) -> LoraIntent:
    """Raises ``msgspec.DecodeError`` or ``msgspec.ValidationError`` for what is not one."""
    return msgspec.json.decode(raw, type=LoraIntent)


class LoraIntentStore(Protocol):
    """Where routers share their intents: a ``Registry`` (Redis for several routers; in
    process for the one router of a static list)."""

    def lora_intents(self) -> dict[str, LoraIntent]:
        """Every adapter's latest intent, by name. Raises ``RegistryError`` when the
        store cannot be reached."""
        ...

    def set_lora_intent(self, intent: LoraIntent, if_seq: int | None = None) -> LoraIntent | None:
        """Write ``intent`` (its ``seq`` ignored) with the next ``seq``, and return it as
        written. With ``if_seq``, only if the name's intent is still that write (0: the
        name has none); None when it is not. Raises ``RegistryError`` when the store
        cannot be reached."""
        ...


class LocalLoraIntents:
    """Intents held in this process: exact for the one router of a static registry."""

    def __init__(self) -> None:
        self._intents: dict[str, LoraIntent] = {}
        self._seq = 0
        self._lock = threading.Lock()  # called from the router's threads (to_thread)

    def lora_intents(self) -> dict[str, LoraIntent]:
        with self._lock:
            return dict(self._intents)

    def set_lora_intent(self, intent: LoraIntent, if_seq: int | None = None) -> LoraIntent | None:
        with self._lock:
            current = self._intents.get(intent.name)
            if if_seq is not None and (current.seq if current else 0) != if_seq:
                return None
            self._seq += 1
            written = msgspec.structs.replace(intent, seq=self._seq)
            self._intents[intent.name] = written
            return written
