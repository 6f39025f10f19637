"""``nats://<bucket>`` as one bucket per pod (shared.kv.objstore.family): a pod writes into its own bucket, reads
every pod's, and a new holder's incremental save references the old holder's packs by an id that names their
bucket; the checkpoint service lists and deletes across all of them; the single bucket of earlier versions still
reads. (What each user may do on a server that enforces it: tests/faults/test_attacks_secured.py.)"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client

from bench.common import Counting
from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.manifest import seal_manifest
from shared.kv.objstore import NatsObjectStore
from shared.kv.objstore.family import PodBuckets, pack_owner
from shared.kv.store import ManifestCorrupt
from shared.kv.stores import open_store
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from shared.wiring import Wiring
from tests.kvkit import LAYOUT, block_content, fill


def make_agent(store: Any, pod: str) -> KvAgent:
    return KvAgent(store, pod=pod, node="node-1", namespace="llm", deployment="llama", layout=LAYOUT)


def grow(agent: KvAgent, session_id: str, index: int) -> None:
    agent.append_block(session_id, block_content(session_id, index, LAYOUT.block_bytes).reshape(2, -1))


@pytest.fixture
async def nc(servers: Any, root: str) -> AsyncIterator[Client]:
    client = await nats.connect(servers.nats_url)
    yield client
    names = json.loads((await client.request("$JS.API.STREAM.NAMES", b"{}")).data).get("streams") or []
    for name in names:
        if root in name:
            with contextlib.suppress(Exception):
                await client.jetstream().delete_stream(name)
    await client.close()


async def test_each_pod_writes_its_own_bucket_and_restores_from_any(nc: Client, root: str) -> None:
    service = open_store(f"nats://{root}", nc)
    assert isinstance(service, PodBuckets) and service.url == f"nats://{root}"
    first = make_agent(open_store(f"nats://{root}", nc, pod="llama-1"), "llama-1")
    originals = {sid: fill(first, sid, 3) for sid in ("s1", "s2")}
    report = await first.save(deadline_s=30, reason="drain")
    assert {c.session_id for c in report.committed} == {"s1", "s2"}, report
    saved = {c.session_id: c.checkpoint_id for c in report.committed}

    second = make_agent(open_store(f"nats://{root}", nc, pod="llama-2"), "llama-2")
    restored = await second.restore("s1", generation=1)  # the service hands the new holder the next one
    assert [bytes(b) for b in restored.blocks] == [a.tobytes() for a in originals["s1"]]
    assert {pack_owner(p) for p in restored.manifest.packs} == {"llama-1"}

    grow(second, "s1", 3)  # the new holder's incremental save: one block of its own, three of llama-1's
    again = await second.save(deadline_s=30, reason="periodic")
    newest = await service.manifest("s1", again.committed[0].checkpoint_id)
    assert newest.pod == "llama-2" and {pack_owner(p) for p in newest.packs} == {"llama-1", "llama-2"}
    assert again.committed[0].bytes_written == LAYOUT.block_bytes  # only the new block was written

    third = make_agent(open_store(f"nats://{root}", nc, pod="llama-3"), "llama-3")
    both = await third.restore("s1")
    assert both.manifest.checkpoint_id == newest.checkpoint_id and len(both.blocks) == 4

    # the checkpoint service's view: every bucket, through the index and the streams
    assert await service.sessions() == ["s1", "s2"]
    assert await service.checkpoints("s1") == [newest.checkpoint_id, saved["s1"]]
    packs = {p.pack_id for p in await service.packs()}
    assert {pack_owner(p) for p in packs} == {"llama-1", "llama-2"}
    assert set(await service.pack_sizes(packs)) == packs
    await service.delete_checkpoint("s1", saved["s1"])
    assert await service.checkpoints("s1") == [newest.checkpoint_id]
    assert await service.sweep_orphans(3600) == 0
    with pytest.raises(Exception, match="opened without a pod"):
        service.open_pack()


async def test_a_manifest_in_a_pods_bucket_written_as_another_pod_is_refused(nc: Client, root: str) -> None:
    """The bucket proves who wrote it: a manifest saying another pod wrote it there is not that pod's."""
    liar = open_store(f"nats://{root}", nc, pod="llama-1")
    agent = make_agent(liar, "llama-1")
    fill(agent, "s1", 1)
    report = await agent.save(deadline_s=30, reason="drain")
    honest = await liar.manifest("s1", report.committed[0].checkpoint_id)
    forged = seal_manifest(
        msgspec.structs.replace(honest, pod="llama-2", checkpoint_id=honest.checkpoint_id[:-1] + "0")
    )
    await liar.commit_manifests([forged])
    with pytest.raises(ManifestCorrupt, match="written as pod 'llama-2'"):
        await open_store(f"nats://{root}", nc).manifest("s1", forged.checkpoint_id)


async def test_the_single_bucket_of_earlier_versions_still_restores(nc: Client, root: str) -> None:
    legacy = NatsObjectStore(nc, root)
    old = make_agent(legacy, "llama-1")
    originals = fill(old, "s1", 2)
    before = await old.save(deadline_s=30, reason="drain")
    await legacy.close()

    holder = make_agent(open_store(f"nats://{root}", nc, pod="llama-2"), "llama-2")
    restored = await holder.restore("s1", generation=1)
    assert [bytes(b) for b in restored.blocks] == [a.tobytes() for a in originals]
    assert {pack_owner(p) for p in restored.manifest.packs} == {""}  # the single bucket's packs
    grow(holder, "s1", 2)
    after = await holder.save(deadline_s=30, reason="periodic")
    service = open_store(f"nats://{root}", nc)
    assert await service.checkpoints("s1") == [after.committed[0].checkpoint_id, before.committed[0].checkpoint_id]
    mixed = await make_agent(open_store(f"nats://{root}", nc, pod="llama-3"), "llama-3").restore("s1")
    assert {pack_owner(p) for p in mixed.manifest.packs} == {"", "llama-2"} and len(mixed.blocks) == 3


async def test_the_checkpoint_service_makes_a_pods_bucket_when_it_first_hears_the_pod(
    nc: Client, root: str, settings: Settings, subjects: Subjects, bus: Bus
) -> None:
    """A pod may not create a stream on a secured server (tests/faults/test_attacks_secured.py): its bucket is
    there, with the family's configuration, once its first announcement is answered, and made once however often
    the pod announces (the cost follows new pods)."""
    store = Counting(open_store(f"nats://{root}", nc))
    running = await start_service(CheckpointService(CheckpointSettings(gc_interval_s=0), store=store), settings, Wiring)
    bucket = f"OBJ_{root}-llama-1"
    agent_bus = await Bus.connect(settings.nats, subjects, "agent/llama-1")
    endpoint = AgentEndpoint(make_agent(open_store(f"nats://{root}", nc, pod="llama-1"), "llama-1"), agent_bus)
    try:
        assert "error" in json.loads((await nc.request(f"$JS.API.STREAM.INFO.{bucket}", b"")).data)
        await endpoint.start()  # its first announcement, answered
        info = json.loads((await nc.request(f"$JS.API.STREAM.INFO.{bucket}", b"")).data)
        assert info["config"]["subjects"] == [f"$O.{root}-llama-1.C.>", f"$O.{root}-llama-1.M.>"], info
        for _ in range(3):
            await endpoint.announce()
        assert store.calls["provision"] == 1
    finally:
        await endpoint.stop()
        await agent_bus.close(grace=0.5)
        await running.stop(grace=1)
