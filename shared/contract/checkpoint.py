"""KV-cache checkpoint events: a session's cache committed, failed or restored."""

from __future__ import annotations

from typing import ClassVar

from shared.contract.base import Event, Token


class CheckpointSaved(Event, frozen=True, kw_only=True, tag="checkpoint.saved"):
    """A session's checkpoint is committed: its manifest is visible and every chunk digest was verified."""

    family: ClassVar[str] = "checkpoint"

    session_id: Token
    checkpoint_id: str
    node: str = ""
    pod: str = ""
    deployment: str = ""
    bytes_total: int = 0
    bytes_written: int = 0
    chunks: int = 0
    duration_s: float = 0.0
    drain_id: str = ""


class CheckpointFailed(Event, frozen=True, kw_only=True, tag="checkpoint.failed"):
    family: ClassVar[str] = "checkpoint"

    session_id: Token
    reason: str
    node: str = ""
    pod: str = ""
    drain_id: str = ""


class SessionRestored(Event, frozen=True, kw_only=True, tag="checkpoint.restored"):
    family: ClassVar[str] = "checkpoint"

    session_id: Token
    checkpoint_id: str
    node: str = ""
    pod: str = ""
    bytes_total: int = 0
    duration_s: float = 0.0
