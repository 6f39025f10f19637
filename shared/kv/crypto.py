"""Encryption at rest for KV chunks: AES-256-GCM, a fresh 96-bit nonce per chunk, the chunk's digest as
associated data (a chunk moved under another digest fails to open). The key id is recorded in each manifest so
a restore knows which key it needs and says so when it does not hold it."""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from shared.plumbing.settings import Parse, Secret, any_text, documented, setting, settings_from_env


class KeyError_(ValueError):
    """The encryption key setting is unusable; the message names the variable."""


class ChunkCipher:
    def __init__(self, key: bytes, key_id: str | None = None) -> None:
        if len(key) != 32:
            raise KeyError_(f"AES-256-GCM needs a 32-byte key, got {len(key)} bytes")
        self._aead = AESGCM(key)
        self.key_id = key_id or hashlib.sha256(b"gpuwarden-key-id" + key).hexdigest()[:16]

    def seal(self, plaintext: memoryview, digest: str) -> tuple[bytes, bytes]:
        nonce = os.urandom(12)
        return nonce, self._aead.encrypt(nonce, bytes(plaintext), digest.encode())

    def open(self, sealed: memoryview, nonce: bytes, digest: str) -> bytes:
        try:
            return self._aead.decrypt(nonce, bytes(sealed), digest.encode())
        except InvalidTag:
            raise ValueError("authentication failed (wrong key, or the bytes changed)") from None


def _key(name: str, raw: str) -> Secret:
    """A key as given (base64 of 32 bytes), checked: ``KeyError_`` naming ``name`` unless it is one."""
    try:
        key = base64.b64decode(raw, validate=True)
    except ValueError:
        raise KeyError_(f"{name}: not base64") from None
    if len(key) != 32:
        raise KeyError_(f"{name}: AES-256-GCM needs a 32-byte key, got {len(key)} bytes")
    return Secret(raw)


@dataclass(frozen=True)
class KeySettings:
    key: Secret | None = setting(
        "GPUWARDEN_CHECKPOINT_KEY",
        None,
        "checkpoint, agents: encryption key for checkpoints at rest, base64 of 32 bytes (AES-256-GCM per chunk; or "
        "GPUWARDEN_CHECKPOINT_KEY_FILE)",
        parse=Parse(_key, lambda _: ""),
        or_file=True,
    )
    """None: checkpoints are not encrypted."""
    key_id: str = setting(
        "GPUWARDEN_CHECKPOINT_KEY_ID",
        "",
        "checkpoint, agents: an id for the key, written into each manifest",
        parse=any_text(),
        shown="derived from the key",
    )


DOCUMENTED = documented(KeySettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def cipher_from_env(env: Mapping[str, str] | None = None) -> ChunkCipher | None:
    """``GPUWARDEN_CHECKPOINT_KEY`` (base64 of 32 bytes) or ``GPUWARDEN_CHECKPOINT_KEY_FILE``; None when unset.
    A key that is no such key is refused naming the variable (``KeyError_``)."""
    found = settings_from_env(KeySettings, env)
    if found.key is None:
        return None
    return ChunkCipher(base64.b64decode(found.key.reveal()), found.key_id or None)
