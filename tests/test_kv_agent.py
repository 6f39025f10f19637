"""The KV agent and the file store: save, incremental save, restore byte for byte, and every way it can fail."""

from __future__ import annotations

import base64
import contextlib
import os
import resource
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.kv.agent import KvAgent
from shared.kv.crypto import ChunkCipher, cipher_from_env
from shared.kv.filestore import FileStore
from shared.kv.manifest import IncompatibleCheckpoint, KvLayout
from shared.kv.store import ChunkCorrupt
from tests.kvkit import LAYOUT, block_content, fill, flip_byte, make_agent, small_disk


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


@pytest.fixture(params=["file", "nats"])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path, servers: Any, root: str) -> AsyncIterator[Any]:
    """Each behaviour both stores promise runs against both: the file store and the NATS object store."""
    if request.param == "file":
        yield FileStore(tmp_path / "store")
        return
    import nats

    from shared.kv.objstore import NatsObjectStore

    nc = await nats.connect(servers.nats_url)
    objects = NatsObjectStore(nc, root)
    yield objects
    await objects.close()
    with contextlib.suppress(Exception):
        await nc.jetstream().delete_object_store(root)
    await nc.close()


async def stored_pack_bytes(store: Any, pack: str) -> bytes:
    if isinstance(store, FileStore):
        return (store.packs_dir / f"{pack}.pack").read_bytes()
    return bytes(await store.read_object(f"packs/{pack}"))


async def test_save_and_restore_byte_for_byte_on_another_pod(any_store: Any) -> None:
    store = any_store
    saver = make_agent(store)
    originals = {sid: fill(saver, sid, 5) for sid in ("s1", "s2", "s3")}
    report = await saver.save(deadline_s=30, reason="drain")
    assert not report.failed and len(report.committed) == 3
    assert report.bytes_written == report.bytes_total == 3 * 5 * LAYOUT.block_bytes
    restorer = make_agent(store, pod="llama-2")
    for sid, blocks in originals.items():
        restored = await restorer.restore(sid)
        assert restored.manifest.token_count == 5 * 16
        assert [bytes(b) for b in restored.blocks] == [b.tobytes() for b in blocks]
    assert set(restorer.sessions()) == {"s1", "s2", "s3"}


async def test_restore_into_preallocated_buffers_of_any_kind(any_store: Any) -> None:
    store = any_store
    saver = make_agent(store)
    blocks = fill(saver, "s1", 3)
    await saver.save()
    pool = [np.zeros((2, LAYOUT.block_bytes // 2), dtype=np.uint8), bytearray(LAYOUT.block_bytes)]
    dlpack_target = np.zeros(LAYOUT.block_bytes // 2, dtype=np.float16)
    restorer = make_agent(store, pod="llama-2")
    await restorer.restore("s1", into=[*pool, dlpack_target])
    assert pool[0].tobytes() == blocks[0].tobytes()
    assert bytes(pool[1]) == blocks[1].tobytes()
    assert dlpack_target.tobytes() == blocks[2].tobytes()
    with pytest.raises(ValueError, match="3 blocks in the checkpoint, 1 given"):
        await restorer.restore("s1", into=[bytearray(LAYOUT.block_bytes)])


async def test_incremental_save_writes_only_changed_blocks(any_store: Any) -> None:
    store = any_store
    agent = make_agent(store)
    blocks = fill(agent, "s1", 10)
    first = (await agent.save()).committed[0]
    blocks[3][:] = 7  # one full block rewritten in place, which the engine declares
    agent.update_block("s1", 3)
    agent.append_block("s1", block_content("s1", 10, LAYOUT.block_bytes))
    second = (await agent.save()).committed[0]
    assert second.parent_id == first.checkpoint_id
    assert second.bytes_written == 2 * LAYOUT.block_bytes
    assert second.bytes_total == 11 * LAYOUT.block_bytes
    sizes = {p.pack_id: p.size for p in await store.packs()}
    assert sizes[second.blocks[3].pack] == 2 * LAYOUT.block_bytes  # only the changed blocks were written
    restored = await make_agent(store, pod="p2").restore("s1")
    assert [bytes(b) for b in restored.blocks] == [b.tobytes() for b in blocks] + [
        block_content("s1", 10, LAYOUT.block_bytes).tobytes()
    ]
    # the new agent learns the parent from the store, so its next save is incremental too
    again = make_agent(store, pod="p2")
    await again.restore("s1")
    third = (await again.save()).committed[0]
    assert third.bytes_written == 0 and third.parent_id == second.checkpoint_id


async def test_partial_last_block_is_copied_before_hashing(any_store: Any) -> None:
    store = any_store
    agent = make_agent(store)
    fill(agent, "s1", 2)
    agent.set_tokens("s1", 20)  # block 1 is partial: the engine may still write it
    manifest = (await agent.save()).committed[0]
    assert manifest.token_count == 20 and len(manifest.blocks) == 2


async def test_bit_flip_is_detected_names_the_block_and_falls_back(store: FileStore) -> None:
    agent = make_agent(store)
    blocks = fill(agent, "s1", 4)
    older = (await agent.save()).committed[0]
    blocks[2][0, 0] ^= 0xFF
    agent.update_block("s1", 2)
    newer = (await agent.save()).committed[0]
    changed = newer.blocks[2]
    assert changed.pack != older.blocks[2].pack
    flip_byte(store, changed.pack, changed.offset + 100)
    restorer = make_agent(store, pod="p2")
    with pytest.raises(ChunkCorrupt, match=f"checkpoint {newer.checkpoint_id}: block 2 is corrupt: digest mismatch"):
        await restorer.restore("s1", fall_back=False)
    restored = await restorer.restore("s1")
    assert restored.manifest.checkpoint_id == older.checkpoint_id
    assert "block 2" in restored.fell_back_from[0]
    assert bytes(restored.blocks[2]) != blocks[2].tobytes()  # the older content, verified
    # a flipped byte in a block both checkpoints share: nothing good is left, and it says so
    flip_byte(store, older.blocks[0].pack, older.blocks[0].offset)
    with pytest.raises(ChunkCorrupt, match="no usable checkpoint of session"):
        await make_agent(store, pod="p3").restore("s1")


async def test_truncated_pack_is_detected(store: FileStore) -> None:
    agent = make_agent(store)
    fill(agent, "s1", 4)
    manifest = (await agent.save()).committed[0]
    path = store.packs_dir / f"{manifest.blocks[0].pack}.pack"
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(ChunkCorrupt, match="truncated"):
        await make_agent(store, pod="p2").restore("s1")


async def test_restore_into_another_model_or_layout_is_refused(any_store: Any) -> None:
    store = any_store
    agent = make_agent(store)
    fill(agent, "s1", 2)
    await agent.save()
    other = KvAgent(
        store,
        pod="p2",
        node="n2",
        namespace="llm",
        deployment="llama",
        layout=KvLayout(**{**{f: getattr(LAYOUT, f) for f in KvLayout.__struct_fields__}, "model_version": "2"}),
    )
    with pytest.raises(IncompatibleCheckpoint, match="model_version: checkpoint has '1', this pod has '2'"):
        await other.restore("s1")


async def test_encrypted_at_rest_and_refused_without_the_key(any_store: Any) -> None:
    store = any_store
    key = os.urandom(32)
    cipher = cipher_from_env({"GPUWARDEN_CHECKPOINT_KEY": base64.b64encode(key).decode()})
    assert cipher is not None
    agent = make_agent(store, cipher=cipher)
    blocks = fill(agent, "s1", 3)
    manifest = (await agent.save()).committed[0]
    assert manifest.key_id == cipher.key_id
    raw = await stored_pack_bytes(store, manifest.blocks[0].pack)
    assert blocks[0].tobytes()[:64] not in raw
    restored = await make_agent(store, pod="p2", cipher=ChunkCipher(key)).restore("s1")
    assert [bytes(b) for b in restored.blocks] == [b.tobytes() for b in blocks]
    with pytest.raises(ChunkCorrupt, match="encrypted with key"):
        await make_agent(store, pod="p3").restore("s1", fall_back=False)
    with pytest.raises(ChunkCorrupt, match="authentication failed"):
        await make_agent(store, pod="p4", cipher=ChunkCipher(os.urandom(32), cipher.key_id)).restore(
            "s1", fall_back=False
        )


async def test_deadline_fails_the_sessions_by_name_and_leaves_nothing_visible(any_store: Any) -> None:
    store = any_store
    agent = make_agent(store)
    fill(agent, "s1", 2)
    report = await agent.save(deadline_s=-1)
    assert [f.session_id for f in report.failed] == ["s1"] and "deadline" in report.failed[0].reason
    assert await store.checkpoints("s1") == []
    assert await store.packs() == []
    missing = await agent.save(["nope"])
    assert missing.failed[0].reason == "not registered on pod llama-1"


async def restores_as(store: Any, session_id: str, blocks: list[Any], checkpoint_id: str) -> None:
    """Another pod restores the session's newest checkpoint, every chunk verified, and gets these blocks."""
    restored = await make_agent(store, pod="elsewhere").restore(session_id, fall_back=False)
    assert restored.manifest.checkpoint_id == checkpoint_id
    assert [bytes(b) for b in restored.blocks] == [np.asarray(b).tobytes() for b in blocks]


async def test_a_save_writes_again_the_blocks_of_a_pack_the_store_lost(any_store: Any) -> None:
    """The old way: each save referenced its base's chunks in a deleted pack, so every later save of those
    sessions committed a checkpoint that could not restore (and the checkpoint service refused it, forever)."""
    store = any_store
    agent = make_agent(store)
    blocks = {sid: fill(agent, sid, 4) for sid in ("s1", "s2")}
    first = {m.session_id: m for m in (await agent.save()).committed}
    lost = first["s1"].blocks[0].pack
    assert {ref.pack for m in first.values() for ref in m.blocks} == {lost}  # one round, one pack
    blocks["s1"].append(block_content("s1", 4, LAYOUT.block_bytes))
    agent.append_block("s1", blocks["s1"][-1])
    second = (await agent.save(["s1"])).committed[0]
    assert second.bytes_written == LAYOUT.block_bytes and second.blocks[0].pack == lost
    await store.delete_pack(lost)  # an operator, a bucket purge, a disk: the pack is gone
    healed = await agent.save()
    assert not healed.failed
    by_session = {m.session_id: m for m in healed.committed}
    assert by_session["s1"].bytes_written == 4 * LAYOUT.block_bytes  # the lost four; the fifth is referenced
    assert by_session["s2"].bytes_written == 4 * LAYOUT.block_bytes
    assert all(ref.pack != lost for m in healed.committed for ref in m.blocks)
    for sid, m in by_session.items():
        await restores_as(store, sid, blocks[sid], m.checkpoint_id)
    again = await agent.save()
    assert again.bytes_written == 0  # healed once: nothing is written twice


async def test_a_save_writes_again_only_the_chunks_past_the_end_of_a_short_pack(store: FileStore) -> None:
    agent = make_agent(store)
    blocks = fill(agent, "s1", 4)
    first = (await agent.save()).committed[0]
    path = store.packs_dir / f"{first.blocks[0].pack}.pack"
    os.truncate(path, path.stat().st_size - 10)  # the last chunk is cut short
    healed = (await agent.save()).committed[0]
    assert healed.bytes_written == LAYOUT.block_bytes
    assert [ref.pack == first.blocks[0].pack for ref in healed.blocks] == [True, True, True, False]
    await restores_as(store, "s1", blocks, healed.checkpoint_id)


async def test_a_save_whose_base_manifest_is_gone_references_nothing_of_it(any_store: Any) -> None:
    """Retention finds the packs to keep through manifests: chunks of a checkpoint that is gone may be collected
    at any time, so a save must not build on them."""
    store = any_store
    agent = make_agent(store)
    blocks = fill(agent, "s1", 3)
    first = (await agent.save()).committed[0]
    await store.delete_checkpoint("s1", first.checkpoint_id)
    healed = (await agent.save()).committed[0]
    assert healed.bytes_written == healed.bytes_total == 3 * LAYOUT.block_bytes
    assert all(ref.pack != first.blocks[0].pack for ref in healed.blocks)
    await restores_as(store, "s1", blocks, healed.checkpoint_id)


async def test_rewrite_writes_every_block_again_even_when_nothing_changed(any_store: Any) -> None:
    store = any_store
    agent = make_agent(store)
    blocks = {sid: fill(agent, sid, 3) for sid in ("s1", "s2")}
    first = {m.session_id: m for m in (await agent.save()).committed}
    report = await agent.save(changed_only=True, rewrite=["s1", "not-saved-here"])
    assert report.unchanged == 1 and not report.failed  # s2: nothing new; s1 saved all the same
    (rewritten,) = report.committed
    assert rewritten.session_id == "s1" and rewritten.bytes_written == rewritten.bytes_total == 3 * LAYOUT.block_bytes
    assert all(ref.pack != first["s1"].blocks[0].pack for ref in rewritten.blocks)
    await restores_as(store, "s1", blocks["s1"], rewritten.checkpoint_id)
    assert (await agent.save(["s1"])).bytes_written == 0  # the rewritten checkpoint is the new base


class CountingStore:
    """A store that counts what the agent asks of it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.asked: dict[str, list[int]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def pack_sizes(self, pack_ids: Any) -> dict[str, int]:
        ids = set(pack_ids)
        self.asked.setdefault("pack_sizes", []).append(len(ids))
        return await self.inner.pack_sizes(ids)

    async def manifests_present(self, checkpoints: Any) -> set[tuple[str, str]]:
        pairs = set(checkpoints)
        self.asked.setdefault("manifests_present", []).append(len(pairs))
        return await self.inner.manifests_present(pairs)


async def test_a_save_round_asks_the_store_twice_whatever_its_sessions_and_blocks(store: FileStore) -> None:
    """Checking what the store still holds costs one call for the round's base checkpoints and one for the
    distinct packs they reference: never a call per block or per session."""
    counting = CountingStore(store)
    agent = make_agent(counting)  # type: ignore[arg-type]
    sessions = [f"s{i}" for i in range(12)]
    for sid in sessions[:6]:
        fill(agent, sid, 5)
    await agent.save()  # nothing to build on: nothing asked
    assert counting.asked == {}
    for sid in sessions[6:]:
        fill(agent, sid, 5)
    await agent.save(sessions[6:])  # a second pack
    for sid in sessions:
        agent.append_block(sid, block_content(sid, 9, LAYOUT.block_bytes))
    counting.asked.clear()
    report = await agent.save()
    assert len(report.committed) == 12 and report.bytes_written == 12 * LAYOUT.block_bytes
    assert counting.asked == {"manifests_present": [12], "pack_sizes": [2]}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs for a real ENOSPC needs root")
async def test_disk_full_fails_the_save_with_the_reason_and_keeps_older_checkpoints(tmp_path: Path) -> None:
    with small_disk(tmp_path / "tiny", "1m") as root:
        store = FileStore(root)
        agent = make_agent(store)
        blocks = fill(agent, "s1", 8)  # 128 KiB
        older = (await agent.save()).committed[0]
        for i in range(60):  # about 1 MiB more than fits
            agent.append_block("s1", block_content("s1", 100 + i, LAYOUT.block_bytes))
        report = await agent.save()
        assert report.failed and "disk full" in report.failed[0].reason
        assert await store.checkpoints("s1") == [older.checkpoint_id]
        assert not [p for p in store.packs_dir.iterdir() if p.name.startswith(".tmp")]
        restored = await make_agent(store, pod="p2").restore("s1")
        assert [bytes(b) for b in restored.blocks] == [b.tobytes() for b in blocks]


def test_write_error_from_a_file_size_limit_is_a_store_error(tmp_path: Path) -> None:
    """Without root: RLIMIT_FSIZE makes the kernel refuse the write (EFBIG), like a failing disk would."""
    import asyncio

    store = FileStore(tmp_path / "s")
    agent = make_agent(store)
    fill(agent, "s1", 8)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, hard))
    try:
        report = asyncio.run(agent.save())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert report.failed and "File too large" in report.failed[0].reason
    assert asyncio.run(store.checkpoints("s1")) == []


def test_the_documented_example_runs(tmp_path: Path) -> None:
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "shared.kv.example", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "byte for byte True" in result.stdout
    assert "incremental save of a: 262,144 of 2,097,152 bytes written" in result.stdout
