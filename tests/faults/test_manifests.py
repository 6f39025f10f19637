"""Manifests verify themselves and restores fall back over anything unusable to the newest good checkpoint,
saying which they used and why; a chunk found corrupt is never referenced by a later save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.contract.node import DrainCompleted, DrainRequested
from shared.kv.agent import KvAgent
from shared.kv.filestore import FileStore
from shared.kv.manifest import CheckpointManifest
from shared.kv.store import ChunkCorrupt, ManifestCorrupt
from tests.faults.conftest import Mesh, expected
from tests.helpers import eventually
from tests.kvkit import fill, flip_byte, make_agent


async def two_checkpoints(store: FileStore) -> tuple[KvAgent, CheckpointManifest, CheckpointManifest]:
    agent = make_agent(store)
    fill(agent, "s1", 3)
    older = (await agent.save()).committed[0]
    agent.append_block("s1", expected("s1", 4)[3])
    newer = (await agent.save()).committed[0]
    assert newer.checkpoint_id > older.checkpoint_id and newer.sequence == older.sequence + 1
    return agent, older, newer


def manifest_path(store: FileStore, m: CheckpointManifest) -> Path:
    return store.sessions_dir / m.session_id / f"{m.checkpoint_id}.json"


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


async def test_an_edited_token_count_is_refused_and_the_older_checkpoint_restores(store: FileStore) -> None:
    _, older, newer = await two_checkpoints(store)
    path = manifest_path(store, newer)
    doc = json.loads(path.read_bytes())
    doc["token_count"] = 10_000  # well-formed, plausible, and a lie
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestCorrupt, match="digest does not match"):
        await store.manifest("s1", newer.checkpoint_id)
    restored = await make_agent(store, "llama-2").restore("s1")
    assert restored.manifest.checkpoint_id == older.checkpoint_id
    assert newer.checkpoint_id in restored.fell_back_from[0] and "digest" in restored.fell_back_from[0]


async def test_another_sessions_manifest_under_this_name_is_refused(store: FileStore) -> None:
    _, older, newer = await two_checkpoints(store)
    other = make_agent(store, "llama-9")
    fill(other, "s2", 5)
    foreign = (await other.save()).committed[0]
    # s2's manifest, intact and self-consistent, placed where s1's newest was
    manifest_path(store, newer).write_bytes(manifest_path(store, foreign).read_bytes())
    restored = await make_agent(store, "llama-2").restore("s1")
    assert restored.manifest.checkpoint_id == older.checkpoint_id
    assert "session 's2'" in restored.fell_back_from[0]


@pytest.mark.parametrize("damage", ["truncated", "garbled", "empty"])
async def test_an_unreadable_newest_manifest_falls_back(store: FileStore, damage: str) -> None:
    _, older, newer = await two_checkpoints(store)
    path = manifest_path(store, newer)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbled": bytes(range(256)) * 3, "empty": b""}[damage])
    restored = await make_agent(store, "llama-2").restore("s1")
    assert restored.manifest.checkpoint_id == older.checkpoint_id
    assert [bytes(b) for b in restored.blocks] == expected("s1", 3)
    assert "unreadable" in restored.fell_back_from[0]


async def test_a_deleted_newest_manifest_restores_the_older_one_not_a_fresh_session(mesh: Mesh) -> None:
    pod = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=3)
    assert await mesh.periodic_turn() == 1
    pod.grow("s1", 1)
    assert await mesh.periodic_turn() == 1
    recorded = await mesh.service.registry.checkpoints("s1")
    assert len(recorded) == 2
    newest = str(recorded[0]["checkpoint_id"])
    (mesh.store.sessions_dir / "s1" / f"{newest}.json").unlink()
    await mesh.evict(pod)
    other = await mesh.add_pod("llama-2", "node-2")
    restored = await other.endpoint.restore("s1")
    assert [bytes(b) for b in restored.blocks] == expected("s1", 3)
    assert restored.fell_back_from and newest in restored.fell_back_from[0]
    await mesh.check(min_checkpoints=1, corrupted=[newest])


async def test_a_chunk_found_corrupt_is_rewritten_not_referenced(mesh: Mesh) -> None:
    """The old way: a pod that found every checkpoint corrupt started the session afresh, recomputed the same
    blocks, and its next save referenced the corrupt chunk by digest: born corrupt, yet the drain completed."""
    first_pod = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=3)
    assert await mesh.periodic_turn() == 1
    (first,) = await mesh.service.registry.checkpoints("s1")
    manifest = await mesh.store.manifest("s1", str(first["checkpoint_id"]))
    flip_byte(mesh.store, manifest.blocks[0].pack, manifest.blocks[0].offset)
    await mesh.evict(first_pod)
    other = await mesh.add_pod("llama-2", "node-2")
    with pytest.raises(ChunkCorrupt):
        await other.endpoint.restore("s1")
    assert other.agent.blocks("s1") == []  # held fresh, under its own generation
    other.grow("s1", 3)  # the engine recomputes the conversation: the same blocks, the same digests
    await mesh.bus.publish(DrainRequested(node="node-2", drain_id="d1", deadline_s=10))
    await eventually(lambda: any(v.drain_id == "d1" for v in mesh.verdicts))
    assert isinstance(mesh.verdicts[-1], DrainCompleted)
    await mesh.evict(other)  # its node drained, it is evicted
    third = await mesh.add_pod("llama-3", "node-3")
    assert [bytes(b) for b in (await third.endpoint.restore("s1")).blocks] == expected("s1", 3)
    await mesh.check(min_checkpoints=1, drains=["d1"], corrupted=[str(first["checkpoint_id"])])
