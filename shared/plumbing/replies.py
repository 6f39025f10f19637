"""Replies as text: what Redis answers (bytes, as the clients here read it without ``decode_responses``) and what
NVML answers (bytes or str, depending on the pynvml version) made ``str`` in one place."""

from __future__ import annotations


def as_text(raw: object) -> str:
    """``raw`` as text: bytes decoded as UTF-8, anything else as ``str`` gives it (a str unchanged)."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)
