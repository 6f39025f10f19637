"""Dead letters: what the consumer loop could not handle, with the reason and the bytes (or their digest)."""

from __future__ import annotations

from typing import ClassVar

from shared.contract.base import Event

# Payloads up to this size travel inside the dead letter; larger ones are represented by their digest and a prefix.
DEAD_LETTER_PAYLOAD_LIMIT = 64 * 1024


class DeadLetter(Event, frozen=True, kw_only=True, tag="deadletter"):
    family: ClassVar[str] = "deadletter"

    origin_subject: str
    reason: str
    consumer: str = ""
    stream: str = ""
    stream_seq: int | None = None
    deliveries: int = 0
    payload_size: int = 0
    payload_sha256: str = ""
    payload: bytes = b""
    payload_truncated: bool = False
