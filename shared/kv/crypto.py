"""Encryption at rest for KV chunks: AES-256-GCM, a fresh 96-bit nonce per chunk, the chunk's digest as
associated data (a chunk moved under another digest fails to open). The key id is recorded in each manifest so
a restore knows which key it needs and says so when it does not hold it."""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM


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


def cipher_from_env(env: Mapping[str, str] | None = None) -> ChunkCipher | None:
    """``GPUWARDEN_CHECKPOINT_KEY`` (base64 of 32 bytes) or ``GPUWARDEN_CHECKPOINT_KEY_FILE``; None when unset."""
    env = os.environ if env is None else env
    raw = env.get("GPUWARDEN_CHECKPOINT_KEY")
    name = "GPUWARDEN_CHECKPOINT_KEY"
    if not raw and env.get("GPUWARDEN_CHECKPOINT_KEY_FILE"):
        name = "GPUWARDEN_CHECKPOINT_KEY_FILE"
        try:
            raw = Path(env[name]).read_text().strip()
        except OSError as exc:
            raise KeyError_(f"{name}={env[name]}: {exc.strerror}") from None
    if not raw:
        return None
    try:
        key = base64.b64decode(raw, validate=True)
    except ValueError:
        raise KeyError_(f"{name}: not base64") from None
    try:
        return ChunkCipher(key, env.get("GPUWARDEN_CHECKPOINT_KEY_ID") or None)
    except KeyError_ as exc:
        raise KeyError_(f"{name}: {exc}") from None
