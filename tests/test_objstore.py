"""The KV agent on the NATS JetStream Object Store (``nats://<bucket>``): the file store's behaviours, plus what
is particular to NATS: chunking, reads of ranges across chunk boundaries, interoperability with nats-py's own
Object Store, server-side corruption and a server restarted in the middle of a save."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from shared.kv.agent import KvAgent
from shared.kv.crypto import ChunkCipher
from shared.kv.filestore import FileStore
from shared.kv.manifest import ChunkRef
from shared.kv.objstore import NatsObjectStore, decode_sequences, encode_sequences
from shared.kv.objstore.family import PodBuckets
from shared.kv.store import ChunkCorrupt, StoreError
from shared.kv.stores import open_store, parse_store_url
from tests.helpers import eventually
from tests.kvkit import LAYOUT, block_content, fill
from tests.servers import NatsServer


def make_agent(store: Any, pod: str = "llama-1", cipher: ChunkCipher | None = None) -> KvAgent:
    return KvAgent(store, pod=pod, node="node-1", namespace="llm", deployment="llama", layout=LAYOUT, cipher=cipher)


async def connect(url: str) -> Client:
    return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, connect_timeout=2)


@pytest.fixture
async def nc(servers: Any) -> AsyncIterator[Client]:
    client = await connect(servers.nats_url)
    yield client
    await client.close()


@pytest.fixture
async def store(nc: Client, root: str) -> AsyncIterator[NatsObjectStore]:
    s = NatsObjectStore(nc, root)
    yield s
    await s.close()
    with contextlib.suppress(Exception):
        await nc.jetstream().delete_object_store(root)


async def stream_subjects(nc: Client, bucket: str, kind: str) -> dict[str, int]:
    """Subjects of the bucket's stream with their message counts; kind "C" (chunks: one token after C, so not the
    per-session index under C.index), "M" (meta) or "C.index" (the index entries)."""
    wildcard = "*" if kind == "C" else ">"
    resp = await nc.request(
        f"$JS.API.STREAM.INFO.OBJ_{bucket}", json.dumps({"subjects_filter": f"$O.{bucket}.{kind}.{wildcard}"}).encode()
    )
    return json.loads(resp.data)["state"].get("subjects") or {}


async def _chunk_count(nc: Client, bucket: str, expected: int) -> bool:
    return sum((await stream_subjects(nc, bucket, "C")).values()) == expected


# -- only the object store (the behaviours both stores share run against both in test_kv_agent.py) -----------
class _FlipInTransit:
    """A store whose packs get one byte flipped after the agent hashed the block (memory or NIC fault on the
    way to NATS). The Object Store's own SHA-256 is computed over the flipped bytes and agrees with them, so
    only the agent's per-block digest can catch it."""

    def __init__(self, inner: NatsObjectStore, at: int) -> None:
        self.inner = inner
        self.at = at

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_pack(self) -> Any:
        writer = self.inner.open_pack()
        at = self.at

        class Flipping:
            pack_id = writer.pack_id

            async def append(self, chunks: Sequence[memoryview]) -> list[int]:
                data = bytearray(b"".join(chunks))
                data[at] ^= 0x01
                offsets = [0]
                for c in chunks[:-1]:
                    offsets.append(offsets[-1] + len(c))
                base = await writer.append([memoryview(data)])
                return [base[0] + o for o in offsets]

            async def commit(self) -> None:
                await writer.commit()

            async def abort(self) -> None:
                await writer.abort()

        return Flipping()


async def test_corruption_after_hashing_is_detected_names_the_block_and_falls_back(store: NatsObjectStore) -> None:
    agent = make_agent(store)
    blocks = fill(agent, "s1", 4)
    older = (await agent.save()).committed[0]
    blocks[2][0, 0] ^= 0xFF
    agent.update_block("s1", 2)
    agent.store = _FlipInTransit(store, at=100)  # type: ignore[assignment]
    newer = (await agent.save()).committed[0]
    assert newer.blocks[2].pack != older.blocks[2].pack
    restorer = make_agent(store, pod="p2")
    with pytest.raises(ChunkCorrupt, match=f"checkpoint {newer.checkpoint_id}: block 2 is corrupt: digest mismatch"):
        await restorer.restore("s1", fall_back=False)
    restored = await restorer.restore("s1")
    assert restored.manifest.checkpoint_id == older.checkpoint_id
    assert "block 2" in restored.fell_back_from[0]
    assert [bytes(b) for b in restored.blocks] != [b.tobytes() for b in blocks]  # the older content, verified
    # nats-py's own reader agrees with the flipped bytes: the Object Store digest cannot see this corruption
    theirs = await (await store.nc.jetstream().object_store(store.bucket)).get(f"packs/{newer.blocks[2].pack}")
    assert theirs.data is not None and theirs.data[100] != blocks[2].tobytes()[100]


async def test_deleted_chunk_is_a_truncated_pack_and_restore_falls_back(store: NatsObjectStore, nc: Client) -> None:
    small = NatsObjectStore(nc, store.bucket, chunk_size=16 * 1024)  # one chunk per block
    agent = make_agent(small)
    blocks = fill(agent, "s1", 4)
    older = (await agent.save()).committed[0]
    for i in (0, 1, 3):
        blocks[i][:] = i
        agent.update_block("s1", i)
    newer = (await agent.save()).committed[0]
    pack = newer.blocks[3].pack
    # the middle chunk of the newer pack goes missing (as when the server drops a message whose checksum fails)
    meta = await nc.jetstream().get_last_msg(f"OBJ_{store.bucket}", f"$O.{store.bucket}.M.{_b64(f'packs/{pack}')}")
    seqs = decode_sequences(json.loads(meta.data)["headers"]["Gpuwarden-Chunk-Sequences"][0])
    assert len(seqs) == 3
    await nc.jetstream().delete_msg(f"OBJ_{store.bucket}", seqs[1])
    with pytest.raises(ChunkCorrupt, match=f"checkpoint {newer.checkpoint_id}: .*pack {pack} is truncated"):
        await make_agent(small, pod="p2").restore("s1", fall_back=False)
    restored = await make_agent(small, pod="p2").restore("s1")
    assert restored.manifest.checkpoint_id == older.checkpoint_id
    assert "truncated" in restored.fell_back_from[0]
    # reading only the chunk before the hole still works; the chunk after it is never taken for the missing one
    first = bytearray(LAYOUT.block_bytes)
    await small.read_chunks([newer.blocks[0]], [memoryview(first)])
    assert bytes(first) == bytes(LAYOUT.block_bytes)
    with pytest.raises(StoreError, match=f"pack {pack} is truncated"):
        await small.read_chunks([newer.blocks[1]], [memoryview(bytearray(LAYOUT.block_bytes))])
    await small.close()


def _b64(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


async def test_deadline_and_abort_leave_nothing_visible(store: NatsObjectStore, nc: Client) -> None:
    agent = make_agent(store)
    fill(agent, "s1", 2)
    report = await agent.save(deadline_s=-1)
    assert [f.session_id for f in report.failed] == ["s1"] and "deadline" in report.failed[0].reason
    assert await store.checkpoints("s1") == []
    assert await store.packs() == []
    # a pack aborted after its chunks went out: purged, nothing visible, nothing left in the stream
    writer = store.open_pack()
    await writer.append([memoryview(os.urandom(3 * store.chunk_size + 5))])
    # three full chunks are out (the last 5 bytes wait in the staging buffer for the commit)
    await eventually(lambda: _chunk_count(nc, store.bucket, 3))
    await writer.abort()
    assert await store.packs() == []
    assert await stream_subjects(nc, store.bucket, "C") == {}
    with pytest.raises(StoreError, match="aborted"):
        await writer.commit()


# -- what is particular to NATS ------------------------------------------------------------------------------------
async def test_a_pack_spans_many_chunks_and_ranges_across_chunk_boundaries_read_back(store: NatsObjectStore) -> None:
    cs = store.chunk_size
    assert cs == 1024 * 1024 and cs <= store.nc.max_payload
    pieces = [os.urandom(n) for n in (cs // 3, 2 * cs + 17, 5, cs - 5, cs, 3 * cs + cs // 2, 1)]
    writer = store.open_pack()
    offsets = await writer.append([memoryview(p) for p in pieces[:3]])
    offsets += await writer.append([memoryview(p) for p in pieces[3:]])
    await writer.commit()
    blob = b"".join(pieces)
    (info,) = await store.packs()
    assert info.pack_id == writer.pack_id and info.size == len(blob) and info.size > 7 * cs
    assert offsets == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    # every piece, plus ranges that straddle boundaries, in shuffled order and with a gap to skip
    ranges = [(o, len(p)) for o, p in zip(offsets, pieces, strict=True)]
    ranges += [(cs - 10, 20), (3 * cs - 1, cs + 2), (len(blob) - 7, 7), (0, 1), (5 * cs, 1)]
    ranges = ranges[::-1]
    refs = [ChunkRef(digest="", size=n, pack=writer.pack_id, offset=o, length=n) for o, n in ranges]
    targets = [bytearray(n) for _, n in ranges]
    await store.read_chunks(refs, [memoryview(t) for t in targets])
    assert [bytes(t) for t in targets] == [blob[o : o + n] for o, n in ranges]
    assert await store.read_object(f"packs/{writer.pack_id}") == blob
    # sparse ranges: chunks in between are skipped (or read through when the gap is one chunk)
    sparse = [(1, 3), (2 * cs + 100, 50), (5 * cs - 1, 2), (len(blob) - 1, 1)]
    refs = [ChunkRef(digest="", size=n, pack=writer.pack_id, offset=o, length=n) for o, n in sparse]
    targets = [bytearray(n) for _, n in sparse]
    await store.read_chunks(refs, [memoryview(t) for t in targets])
    assert [bytes(t) for t in targets] == [blob[o : o + n] for o, n in sparse]


async def test_packs_written_concurrently_interleave_in_the_stream_and_read_back(store: NatsObjectStore) -> None:
    small = NatsObjectStore(store.nc, store.bucket, chunk_size=4096)
    writers = [small.open_pack() for _ in range(3)]
    data = [os.urandom(4096 * 40 + 123) for _ in writers]
    for step in range(0, len(data[0]), 10_000):  # round robin: the chunks of the three packs interleave
        for w, d in zip(writers, data, strict=True):
            await w.append([memoryview(d)[step : step + 10_000]])
    await asyncio.gather(*(w.commit() for w in writers))
    for w, d in zip(writers, data, strict=True):
        ranges = [(0, len(d)), (4000, 9000), (len(d) - 5000, 5000), (81_000, 1)]
        refs = [ChunkRef(digest="", size=n, pack=w.pack_id, offset=o, length=n) for o, n in ranges]
        targets = [bytearray(n) for _, n in ranges]
        await small.read_chunks(refs, [memoryview(t) for t in targets])
        assert [bytes(t) for t in targets] == [d[o : o + n] for o, n in ranges]
    info = await store.nc.jetstream().get_last_msg(
        f"OBJ_{store.bucket}", f"$O.{store.bucket}.M.{_b64(f'packs/{writers[1].pack_id}')}"
    )
    runs = json.loads(info.data)["headers"]["Gpuwarden-Chunk-Sequences"][0]
    assert runs.count(",") > 5  # the sequences really are fragmented
    await small.close()


async def test_the_bucket_is_a_normal_object_store_for_nats_py(store: NatsObjectStore, nc: Client) -> None:
    agent = make_agent(store)
    blocks = fill(agent, "s1", 3)
    manifest = (await agent.save()).committed[0]
    theirs = await nc.jetstream().object_store(store.bucket)
    got = await theirs.get(f"packs/{manifest.blocks[0].pack}")  # nats-py verifies the SHA-256 digest too
    assert got.data == b"".join(b.tobytes() for b in blocks)
    assert got.info.size == 3 * LAYOUT.block_bytes and got.info.options.max_chunk_size == store.chunk_size
    names = sorted(i.name for i in await theirs.list())
    assert names == sorted([f"packs/{manifest.blocks[0].pack}", f"sessions/s1/{manifest.checkpoint_id}.json"])
    # an object nats-py wrote (its 128 KiB chunks, no recorded sequences) reads back through ours, by range
    data = os.urandom(700_000)
    await theirs.put("packs/foreign", data)
    refs = [ChunkRef(digest="", size=n, pack="foreign", offset=o, length=n) for o, n in ((300_000, 200_000), (5, 9))]
    targets = [bytearray(200_000), bytearray(9)]
    await store.read_chunks(refs, [memoryview(t) for t in targets])
    assert bytes(targets[0]) == data[300_000:500_000] and bytes(targets[1]) == data[5:14]
    # an object deleted by nats-py (a deletion marker stays on its meta subject) is gone for us too
    await theirs.delete(f"sessions/s1/{manifest.checkpoint_id}.json")
    assert await store.checkpoints("s1") == []


async def test_listing_deleting_batches_and_sweeping_orphans(store: NatsObjectStore, nc: Client) -> None:
    agent = make_agent(store)
    fill(agent, "s1", 2)
    fill(agent, "s2", 2)
    first = (await agent.save()).committed
    agent.append_block("s1", block_content("s1", 2, LAYOUT.block_bytes))
    second = (await agent.save(["s1"])).committed[0]
    assert await store.checkpoints("s1") == [second.checkpoint_id, first[0].checkpoint_id]  # newest first
    assert await store.sessions() == ["s1", "s2"]
    packs = await store.packs()
    assert len(packs) == 2 and all(p.modified > 0 for p in packs)
    await store.delete_checkpoint("s1", second.checkpoint_id)
    assert await store.checkpoints("s1") == [first[0].checkpoint_id]
    await store.delete_pack(second.blocks[2].pack)
    assert {p.pack_id for p in await store.packs()} == {first[0].blocks[0].pack}
    live = await stream_subjects(nc, store.bucket, "C")
    assert len(live) == 3  # one pack, two manifests
    # a writer that never committed nor aborted (its pod died): swept once old enough, live objects untouched
    orphan = store.open_pack()
    await orphan.append([memoryview(b"x" * 1000)])
    await orphan.finish_chunks()
    assert await store.sweep_orphans(grace_s=3600) == 0
    assert await store.sweep_orphans(grace_s=0) == 1
    assert await stream_subjects(nc, store.bucket, "C") == live
    restored = await make_agent(store, pod="p2").restore("s1")
    assert restored.manifest.checkpoint_id == first[0].checkpoint_id


class _CountingStore(NatsObjectStore):
    """Records every JetStream API request: which subject, with which body."""

    requests: list[tuple[str, dict[str, Any]]]

    async def api(
        self, what: str, subject: str, body: dict[str, Any] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        self.requests.append((subject, body or {}))
        return await super().api(what, subject, body, timeout)


async def test_listing_a_session_reads_its_index_not_the_bucket(nc: Client, root: str) -> None:
    """A restore lists its session's checkpoints: one request for the session's index entries and one meta read
    per checkpoint of that session, however many other sessions the bucket holds."""
    store = _CountingStore(nc, root)
    store.requests = []
    try:
        agent = make_agent(store)
        for i in range(30):
            fill(agent, f"other-{i}", 1)
        fill(agent, "s1", 2)
        await agent.save()
        agent.append_block("s1", block_content("s1", 2, LAYOUT.block_bytes))
        await agent.save(["s1"])
        store.requests.clear()
        assert len(await store.checkpoints("s1")) == 2
        infos = [body for subject, body in store.requests if subject.startswith("STREAM.INFO.")]
        gets = [body for subject, body in store.requests if subject.startswith("STREAM.MSG.GET.")]
        assert infos == [{"subjects_filter": f"$O.{root}.C.index.s1.*", "offset": 0}]
        assert len(gets) == 2 and len(store.requests) == 3
        assert await store.checkpoints("never-saved") == []
    finally:
        await store.close()
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_object_store(root)


async def test_manifests_without_an_index_entry_are_indexed_by_the_sweep(store: NatsObjectStore, nc: Client) -> None:
    """A manifest written before the index existed (or by another client) is listed once the sweep has indexed
    it; an entry whose manifest is gone names nothing and is purged by the sweep."""
    agent = make_agent(store)
    fill(agent, "s1", 2)
    (saved,) = (await agent.save()).committed
    index = await stream_subjects(nc, store.bucket, "C.index")
    assert list(index) == [f"$O.{store.bucket}.C.index.s1.{saved.checkpoint_id}"]
    await store.purge(next(iter(index)))  # as an older version of this store wrote it
    assert await store.checkpoints("s1") == []
    assert await store.sweep_orphans(grace_s=3600) == 0
    assert await store.checkpoints("s1") == [saved.checkpoint_id]
    # an entry of a manifest that never committed (its writer died between the two)
    stale = f"$O.{store.bucket}.C.index.s1.g0000000009-s0000000001-000000000000"
    await nc.jetstream().publish(stale, b"")
    assert await store.checkpoints("s1") == [saved.checkpoint_id]
    assert await store.sweep_orphans(grace_s=3600) == 0  # it may still be on its way: kept for the grace period
    assert await store.sweep_orphans(grace_s=0) == 1
    assert list(await stream_subjects(nc, store.bucket, "C.index")) == [
        f"$O.{store.bucket}.C.index.s1.{saved.checkpoint_id}"
    ]
    await store.delete_checkpoint("s1", saved.checkpoint_id)
    assert await stream_subjects(nc, store.bucket, "C.index") == {}


async def test_server_side_block_file_corruption_is_caught_and_restore_falls_back(
    own_nats: NatsServer, root: str
) -> None:
    """A flipped bit in the server's own block file (Jepsen found such files in practice). Recent servers check
    each message's checksum and drop the message, which reads as a truncated pack; a server that delivered the
    flipped bytes would be caught by the block digest. Either way the restore falls back."""
    client = await connect(own_nats.url)
    store = NatsObjectStore(client, root)
    agent = make_agent(store)
    blocks = fill(agent, "s1", 4)
    older = (await agent.save()).committed[0]
    blocks[2][:] = 9
    agent.update_block("s1", 2)
    newer = (await agent.save()).committed[0]
    await store.close()
    await client.close()
    own_nats.stop()
    flip_in_block_files(Path(own_nats.store), blocks[2].tobytes()[:64])
    own_nats.start()
    client = await connect(own_nats.url)
    store = NatsObjectStore(client, root)
    await eventually(lambda: _ready(store))
    restorer = make_agent(store, pod="p2")
    with pytest.raises(ChunkCorrupt, match=f"checkpoint {newer.checkpoint_id}: .*(truncated|digest mismatch)"):
        await restorer.restore("s1", fall_back=False)
    restored = await restorer.restore("s1")
    assert restored.manifest.checkpoint_id == older.checkpoint_id
    await store.close()
    await client.close()


def flip_in_block_files(store_dir: Path, needle: bytes) -> None:
    for path in store_dir.rglob("*.blk"):
        raw = bytearray(path.read_bytes())
        at = raw.find(needle)
        if at >= 0:
            raw[at + 5] ^= 0x01
            path.write_bytes(bytes(raw))
            return
    raise AssertionError("the block's bytes were not found in the server's block files")


async def _ready(store: NatsObjectStore) -> bool:
    try:
        await store.sessions()
    except StoreError:
        return False
    return True


class _KillMidway:
    """A store whose next pack write kills the NATS server halfway through and restarts it in the background."""

    def __init__(self, inner: NatsObjectStore, server: NatsServer) -> None:
        self.inner = inner
        self.server = server
        self.restarted: asyncio.Task[Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_pack(self) -> Any:
        writer = self.inner.open_pack()
        outer = self

        class Killing:
            pack_id = writer.pack_id

            async def append(self, chunks: Sequence[memoryview]) -> list[int]:
                half = len(chunks) // 2
                offsets = await writer.append(chunks[:half])
                outer.server.kill()
                outer.restarted = asyncio.ensure_future(asyncio.to_thread(_restart_later, outer.server))
                return offsets + await writer.append(chunks[half:])

            async def commit(self) -> None:
                await writer.commit()

            async def abort(self) -> None:
                await writer.abort()

        return Killing()


def _restart_later(server: NatsServer) -> None:
    import time

    time.sleep(0.5)
    server.start()


async def test_nats_restarted_mid_save_leaves_no_partial_checkpoint(own_nats: NatsServer, root: str) -> None:
    client = await connect(own_nats.url)
    store = NatsObjectStore(client, root, ack_timeout=2.0, abort_timeout=1.0)
    agent = make_agent(store)
    blocks = fill(agent, "s1", 8)
    older = (await agent.save()).committed[0]
    for i in range(8, 8 + 512):  # 8 MiB more
        agent.append_block("s1", block_content("s1", i, LAYOUT.block_bytes))
    killer = _KillMidway(store, own_nats)
    agent.store = killer  # type: ignore[assignment]
    report = await agent.save()
    assert killer.restarted is not None
    await killer.restarted
    await eventually(lambda: _ready(store), timeout=20)
    checkpoints = await store.checkpoints("s1")
    if report.failed:  # the usual outcome: chunks were lost with the server
        assert checkpoints == [older.checkpoint_id]
        restored = await make_agent(store, pod="p2").restore("s1")
        assert [bytes(b) for b in restored.blocks] == [b.tobytes() for b in blocks]
    else:
        assert checkpoints == [report.committed[0].checkpoint_id, older.checkpoint_id]
        restored = await make_agent(store, pod="p2").restore("s1")
        assert len(restored.blocks) == 8 + 512
    assert {p.pack_id for p in await store.packs()} == {
        ref.pack for cid in checkpoints for ref in (await store.manifest("s1", cid)).blocks
    }
    # the store works again, and what the failed save left behind (if its purge could not reach the server)
    # is swept
    agent.store = store
    again = await agent.save()
    assert not again.failed
    await store.sweep_orphans(grace_s=0)
    referenced = {ref.pack for cid in await store.checkpoints("s1") for ref in (await store.manifest("s1", cid)).blocks}
    assert {p.pack_id for p in await store.packs()} == referenced
    live = {m.nuid for m in await store._scan_metas()}
    assert set(s.rsplit(".", 1)[1] for s in await stream_subjects(client, root, "C")) == live
    await store.close()
    await client.close()


async def test_commit_manifests_in_one_batch(store: NatsObjectStore) -> None:
    agent = make_agent(store)
    for i in range(20):
        fill(agent, f"s{i:02d}", 1)
    report = await agent.save()
    assert not report.failed and len(report.committed) == 20
    assert await store.sessions() == [f"s{i:02d}" for i in range(20)]
    restored = await make_agent(store, pod="p2").restore("s07")
    assert bytes(restored.blocks[0]) == block_content("s07", 0, LAYOUT.block_bytes).tobytes()


def test_sequence_runs_round_trip() -> None:
    for seqs in ([5], [1, 2, 3, 4], [10, 11, 15, 16, 17, 40], [*range(1000, 3000), 5000]):
        text = encode_sequences(seqs)
        assert decode_sequences(text) == seqs
    assert encode_sequences(list(range(1024, 1024 + 256))) == "1024+256"


async def test_open_store_parses_the_variable(tmp_path: Path, nc: Client, root: str) -> None:
    assert isinstance(open_store(f"file://{tmp_path}/cp"), FileStore)
    store = open_store(f"nats://{root}?replicas=1", nc, pod="llama-1")
    assert isinstance(store, PodBuckets) and store.bucket == root and store.url == f"nats://{root}"
    assert store.owner == "llama-1" and store.replicas == 1
    for bad in ("s3://bucket", "nats://has.dot", "nats://", "nats://b/x", "file://relative", "nats://b?chunk=1", ""):
        with pytest.raises(ValueError, match="GPUWARDEN_CHECKPOINT_STORE"):
            open_store(bad, nc)
    with pytest.raises(ValueError, match="needs a connected NATS client"):
        open_store("nats://bucket")
    assert parse_store_url("nats://kv-cache_1?replicas=3") == ("nats", "kv-cache_1", {"replicas": 3})
    assert parse_store_url("file:///var/lib/cp") == ("file", "/var/lib/cp", {})
