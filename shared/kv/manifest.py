"""Checkpoint manifests: what a checkpoint holds and where each block's bytes are.

A manifest is the commit record of one session's checkpoint. It is written last, atomically, after every byte
it references is durable; a checkpoint without its manifest does not exist. Blocks are content-addressed by their
digest, so a later checkpoint of the same session references unchanged blocks where an earlier one stored them
and writes only what changed.

A KV cache restored into a different model, version, tokenizer, dtype or block layout silently corrupts
output, so ``check_compatible`` refuses it by name.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import msgspec
import xxhash

DIGEST_ALGORITHM = "xxh3-128"


def digest(data: memoryview | bytes | bytearray) -> str:
    """The content digest of one block (xxh3-128: corruption detection at memory speed; the store is trusted
    with integrity against accidents, not against an attacker who can also rewrite manifests)."""
    return xxhash.xxh3_128_hexdigest(data)


class KvLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The shape a KV cache was produced with; restoring into any other shape is refused."""

    model_id: str
    model_version: str
    tokenizer_id: str
    dtype: str
    block_tokens: int
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * _DTYPE_BYTES.get(self.dtype, 2)

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token


_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


class ChunkRef(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Where one block's bytes are: ``pack`` object, byte ``offset`` and stored ``length`` (ciphertext length
    when encrypted), the plaintext ``size`` and ``digest``, and the AES-GCM ``nonce`` when encrypted."""

    digest: str
    size: int
    pack: str
    offset: int
    length: int
    nonce: bytes = b""


class CheckpointManifest(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str
    session_id: str
    namespace: str
    deployment: str
    pod: str
    node: str
    layout: KvLayout
    token_count: int
    blocks: list[ChunkRef]
    created_at: datetime
    digest_algorithm: str = DIGEST_ALGORITHM
    parent_id: str = ""
    key_id: str = ""
    bytes_written: int = 0
    reason: str = ""

    @property
    def bytes_total(self) -> int:
        return sum(b.size for b in self.blocks)

    @property
    def packs(self) -> set[str]:
        return {b.pack for b in self.blocks}


class IncompatibleCheckpoint(ValueError):
    """A checkpoint made for another model, version, tokenizer, dtype or layout."""


def check_compatible(manifest: CheckpointManifest, layout: KvLayout) -> None:
    """Raise ``IncompatibleCheckpoint`` naming every field that differs between the checkpoint and the pod."""
    differences = [
        f"{field}: checkpoint has {getattr(manifest.layout, field)!r}, this pod has {getattr(layout, field)!r}"
        for field in KvLayout.__struct_fields__
        if getattr(manifest.layout, field) != getattr(layout, field)
    ]
    if differences:
        raise IncompatibleCheckpoint(
            f"refusing to restore session {manifest.session_id!r} from checkpoint {manifest.checkpoint_id}: "
            + "; ".join(differences)
        )


def new_checkpoint_id(now: datetime | None = None) -> str:
    """Sortable by creation time, unique across pods: ``20261202T124501123456Z-<12 hex>``."""
    now = now or datetime.now(UTC)
    return now.strftime("%Y%m%dT%H%M%S%fZ") + "-" + uuid.uuid4().hex[:12]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(CheckpointManifest)


def encode_manifest(manifest: CheckpointManifest) -> bytes:
    return _encoder.encode(manifest)


def decode_manifest(data: bytes) -> CheckpointManifest:
    return _decoder.decode(data)
