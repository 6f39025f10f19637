"""Checkpoint manifests: what a checkpoint holds and where each block's bytes are.

A manifest is the commit record of one session's checkpoint. It is written last, atomically, after every byte
it references is durable; a checkpoint without its manifest does not exist. Blocks are content-addressed by their
digest, so a later checkpoint of the same session references unchanged blocks where an earlier one stored them
and writes only what changed.

A KV cache restored into a different model, version, tokenizer, dtype or block layout silently corrupts
output, so ``check_compatible`` refuses it by name.

A manifest verifies itself: ``manifest_digest`` covers every other field (session, layout, parent, blocks, token
count), so an edited or garbled manifest, or another session's manifest stored under this session's name, is
refused by ``verify_manifest`` before a byte is read. Checkpoint ids order a session's checkpoints by
(generation, sequence): the generation is the session's ownership fence (only the pod holding the current
generation may commit), the sequence counts that owner's saves. Never a clock.
"""

from __future__ import annotations

import hashlib
import re
import struct
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime

import msgspec
import xxhash

from shared.contract.base import CheckpointId, SessionId

DIGEST_ALGORITHM = "xxh3-128"


def digest(data: memoryview | bytes | bytearray) -> str:
    """The content digest of one block (xxh3-128: corruption detection at memory speed; the store is trusted
    with integrity against accidents, not against an attacker who can also rewrite manifests)."""
    return xxhash.xxh3_128_hexdigest(data)


class KvLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The shape a KV cache was produced with; restoring into any other shape is refused.

    ``weights_digest`` (SHA-256 of the model's tensors, as an engine adapter computes it), ``tp_rank`` and
    ``tp_size`` came later: they default to what older manifests meant, and are left out of the encoding while
    at their default, so an older manifest re-encodes to the very bytes its ``manifest_digest`` covers."""

    model_id: str
    model_version: str
    tokenizer_id: str
    dtype: str
    block_tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    weights_digest: str = ""
    tp_rank: int = 0
    tp_size: int = 1

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
    pack: CheckpointId
    offset: int
    length: int
    nonce: bytes = b""


class CheckpointManifest(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: CheckpointId
    session_id: SessionId
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
    generation: int = 0
    sequence: int = 0
    manifest_digest: str = ""
    tokens_digest: str = ""
    """``tokens_digest_of`` the token ids whose KV the checkpoint holds (its first ``token_count``), when the engine
    said; '' when it did not. Last of the fields, and left out of the encoding when empty, so manifests written
    before it existed encode, and verify, as they did."""

    @property
    def bytes_total(self) -> int:
        return sum(b.size for b in self.blocks)

    @property
    def packs(self) -> set[str]:
        return {b.pack for b in self.blocks}


class IncompatibleCheckpoint(ValueError):
    """A checkpoint made for another model, version, weights, tokenizer, dtype, layout or tensor-parallel shard."""


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


class ManifestInvalid(ValueError):
    """A manifest that does not verify: its own digest, its session or its id is not what it claims."""


_ID = re.compile(r"^g(?P<generation>\d{10})-s(?P<sequence>\d{10})-[0-9a-f]{12}$")


def new_checkpoint_id(generation: int = 0, sequence: int = 0) -> str:
    """``g<generation>-s<sequence>-<12 hex>``, zero-padded so that the ids of a session sort by (generation,
    sequence) as plain strings, in every store, and unique across pods."""
    return f"g{generation:010d}-s{sequence:010d}-{uuid.uuid4().hex[:12]}"


def checkpoint_order(checkpoint_id: str) -> tuple[int, int, str]:
    """(generation, sequence, id): what "newest" means. Ids of an older format order before every new one."""
    match = _ID.match(checkpoint_id)
    if match is None:
        return (-1, -1, checkpoint_id)
    return (int(match["generation"]), int(match["sequence"]), checkpoint_id)


def newest_first(checkpoint_ids: list[str]) -> list[str]:
    return sorted(checkpoint_ids, key=checkpoint_order, reverse=True)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(CheckpointManifest)


_NO_TOKENS_DIGEST = b',"tokens_digest":""}'


def _canonical(manifest: CheckpointManifest) -> bytes:
    """The encoding: JSON in field order, an empty ``tokens_digest`` (the last field) left out."""
    data = _encoder.encode(manifest)
    if data.endswith(_NO_TOKENS_DIGEST):
        data = data[: -len(_NO_TOKENS_DIGEST)] + b"}"
    return data


def tokens_digest_of(token_ids: Sequence[int]) -> str:
    """SHA-256 over the token ids as little-endian 32-bit integers: the same conversation prefix, the same digest,
    in every engine and process. (No numpy here: the manifest is read by every command that names a store.)"""
    ids = [int(t) for t in token_ids]
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


def manifest_digest(manifest: CheckpointManifest) -> str:
    """SHA-256 of the manifest's canonical encoding with ``manifest_digest`` empty (``tokens_digest`` included)."""
    return hashlib.sha256(_canonical(msgspec.structs.replace(manifest, manifest_digest=""))).hexdigest()


def seal_manifest(manifest: CheckpointManifest) -> CheckpointManifest:
    return msgspec.structs.replace(manifest, manifest_digest=manifest_digest(manifest))


def verify_manifest(manifest: CheckpointManifest, session_id: str, checkpoint_id: str) -> None:
    """Raise ``ManifestInvalid`` unless the manifest is intact and is the one asked for: its digest matches its
    content, it names ``session_id`` and ``checkpoint_id``, its parent precedes it, and its blocks are whole."""
    where = f"checkpoint {checkpoint_id} of session {session_id!r}"
    if not manifest.manifest_digest:
        raise ManifestInvalid(f"{where}: the manifest carries no digest of its own")
    if manifest_digest(manifest) != manifest.manifest_digest:
        raise ManifestInvalid(f"{where}: the manifest's digest does not match its content (edited or garbled)")
    if manifest.session_id != session_id:
        raise ManifestInvalid(f"{where}: the manifest is session {manifest.session_id!r}'s")
    if manifest.checkpoint_id != checkpoint_id:
        raise ManifestInvalid(f"{where}: the manifest is checkpoint {manifest.checkpoint_id}'s")
    if manifest.parent_id and checkpoint_order(manifest.parent_id) >= checkpoint_order(checkpoint_id):
        raise ManifestInvalid(f"{where}: its parent {manifest.parent_id} does not precede it")
    if checkpoint_order(checkpoint_id)[:2] not in ((manifest.generation, manifest.sequence), (-1, -1)):
        raise ManifestInvalid(f"{where}: its id does not carry its generation and sequence")
    if manifest.token_count < 0 or any(ref.size <= 0 or ref.length < ref.size for ref in manifest.blocks):
        raise ManifestInvalid(f"{where}: a block or the token count is out of range")


def encode_manifest(manifest: CheckpointManifest) -> bytes:
    return _canonical(manifest)


def decode_manifest(data: bytes) -> CheckpointManifest:
    return _decoder.decode(data)


def lost_pack(manifest: CheckpointManifest, pack_sizes: Mapping[str, int]) -> str:
    """Why the blocks of ``manifest`` cannot all be read back from packs of these sizes ('' when they can): a
    pack missing, or shorter than a block it holds ends."""
    for ref in manifest.blocks:
        size = pack_sizes.get(ref.pack)
        if size is None:
            return f"pack {ref.pack} missing"
        if size < ref.offset + ref.length:
            return f"pack {ref.pack} short: {size} bytes, a block ends at {ref.offset + ref.length}"
    return ""
