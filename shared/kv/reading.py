"""A checkpoint's chunks read back verified: the restore's read path (rounds read while the previous round is
checked, decryption, every digest compared, device targets filled from one staging copy). ``KvAgent.restore``
decides which checkpoint to read; this reads one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shared.kv.buffers import Block, Staging, as_block
from shared.kv.crypto import ChunkCipher
from shared.kv.manifest import CheckpointManifest, digest
from shared.kv.store import CheckpointStore, ChunkCorrupt, StoreError

RESTORE_ROUND_BYTES = 16 * 1024 * 1024  # bytes read per round on restore; the previous round is verified meanwhile


def _verify_chunk(
    cipher: ChunkCipher | None,
    manifest: CheckpointManifest,
    i: int,
    view: memoryview,
    target: Block,
    in_place: bool,
    offset: int,
    to_device: list[tuple[int, Block]],
) -> None:
    ref = manifest.blocks[i]
    if manifest.key_id:
        if cipher is None or cipher.key_id != manifest.key_id:
            raise ChunkCorrupt(manifest.checkpoint_id, i, f"encrypted with key {manifest.key_id!r}, not held")
        try:
            plain = cipher.open(view, ref.nonce, ref.digest)
        except ValueError as exc:
            raise ChunkCorrupt(manifest.checkpoint_id, i, str(exc)) from None
        view = view[: ref.size]
        view[:] = plain
    if digest(view) != ref.digest:
        raise ChunkCorrupt(manifest.checkpoint_id, i, "digest mismatch")
    if target.on_device:
        to_device.append((offset, target))
    elif not in_place:
        assert target.host is not None
        target.host[:] = view


async def read_verified(
    store: CheckpointStore,
    cipher: ChunkCipher | None,
    manifest: CheckpointManifest,
    into: Sequence[Any] | None,
    staging_for: Callable[[int], Staging],
) -> list[Any]:
    """Read ``manifest``'s chunks into ``into`` (the engine's own blocks, host or device) or new host arrays,
    decrypting with ``cipher`` where the manifest says so and verifying every chunk's digest; ``ChunkCorrupt``
    names the first that fails. Reads go in rounds of ``RESTORE_ROUND_BYTES``, each verified while the next is
    read; what cannot land in place goes through ``staging_for(bytes)``."""
    refs = manifest.blocks
    if into is not None:
        if len(into) != len(refs):
            raise ValueError(
                f"restore of {manifest.session_id}: {len(refs)} blocks in the checkpoint, {len(into)} given"
            )
        targets = [as_block(b) for b in into]
        for i, (t, ref) in enumerate(zip(targets, refs, strict=True)):
            if t.nbytes != ref.size:
                raise ValueError(f"restore target block {i} has {t.nbytes} bytes, checkpoint block {ref.size}")
        out = list(into)
    else:
        out = [np.empty(ref.size, dtype=np.uint8) for ref in refs]
        targets = [as_block(a) for a in out]
    direct = cipher is None and manifest.key_id == ""
    in_place = [direct and not t.on_device for t in targets]
    staged = sum(r.length for r, ok in zip(refs, in_place, strict=True) if not ok)
    staging = staging_for(staged) if staged else None
    views: list[memoryview] = []
    offsets: list[int] = []
    offset = 0
    for ref, target, ok in zip(refs, targets, in_place, strict=True):
        if ok:
            assert target.host is not None
            views.append(target.host)
            offsets.append(-1)
        else:
            assert staging is not None
            views.append(staging.view[offset : offset + ref.length])
            offsets.append(offset)
            offset += ref.length
    # Read in rounds and verify round k while round k+1 is read: the reads run in I/O threads (no GIL), so
    # checking digests costs little more than the disk already does.
    rounds: list[list[int]] = []
    size = 0
    for i, ref in enumerate(refs):
        if not rounds or size >= RESTORE_ROUND_BYTES:
            rounds.append([])
            size = 0
        rounds[-1].append(i)
        size += ref.length

    async def read(indexes: list[int]) -> None:
        try:
            await store.read_chunks([refs[i] for i in indexes], [views[i] for i in indexes])
        except StoreError as exc:
            raise ChunkCorrupt(manifest.checkpoint_id, -1, str(exc)) from exc

    to_device: list[tuple[int, Block]] = []
    pending = asyncio.ensure_future(read(rounds[0])) if rounds else None
    try:
        for k, indexes in enumerate(rounds):
            assert pending is not None
            await pending
            pending = asyncio.ensure_future(read(rounds[k + 1])) if k + 1 < len(rounds) else None
            for i in indexes:
                _verify_chunk(cipher, manifest, i, views[i], targets[i], in_place[i], offsets[i], to_device)
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
    if to_device:
        assert staging is not None
        await asyncio.to_thread(staging.host_to_device, to_device)
    return out
