"""The journal's node tier on real files: blocks logged on the node as they fill, a pod killed going on on the same
node from its checkpoint plus the dead pod's log (at most a block lost), the shared store written only every spill
period or sooner under the node's byte budget, logs deleted once the store's copy is recorded, and a log that is
cut short, damaged, encrypted or of another history read only as far as it is right."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from shared.kv.agent import KvAgent, SaveReport
from shared.kv.crypto import ChunkCipher
from shared.kv.filestore import FileStore
from shared.kv.journal import KvJournal, journal_options, journal_settings, node_tier_of
from shared.kv.manifest import digest
from shared.kv.nodetier import HEADER, NodeTier
from shared.plumbing.errors import SettingsError
from tests.kvkit import LAYOUT, block_content, make_agent
from tests.test_kv_journal import decode

BT = LAYOUT.block_tokens
BLOCK = LAYOUT.block_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def recorder(recorded: list[str]):  # type: ignore[no-untyped-def]
    async def record(report: SaveReport) -> set[str]:
        ids = {m.checkpoint_id for m in report.committed}
        recorded.extend(sorted(ids))
        return ids

    return record


async def resume(store: FileStore, tier_root: Path, pod: str, came_from: str, generation: int) -> KvAgent:
    """What a restore on the same node does (``AgentEndpoint._continue_from_node``): the newest checkpoint, then
    the previous pod's log on top of it."""
    agent = make_agent(store, pod=pod)
    restored = await agent.restore("s1", generation=generation + 1)
    tier = NodeTier(tier_root, pod)
    tail = await tier.continue_session(agent, "s1", restored.manifest, generation + 1, came_from, generation)
    assert tail.why_not == "" and tier.next_block("s1", generation + 1) == restored.manifest.token_count // BT
    return agent


async def test_a_pod_killed_goes_on_on_its_node_from_the_checkpoint_and_the_dead_pods_log(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    root = tmp_path / "node"
    agent = make_agent(store)
    agent.register_session("s1", generation=3)
    clock = Clock()
    recorded: list[str] = []
    journal = KvJournal(agent, 1.0, recorder(recorded), node=NodeTier(root, "llama-1"), spill_s=60.0, clock=clock)
    decode(agent, "s1", BT + 3)
    await journal._tick()  # block 0 logged; the store holds nothing of the session yet: it goes there at once
    assert len(recorded) == 1 and journal.stats.entries == 1
    decode(agent, "s1", 5 * BT + 7)
    clock.now += 1.0
    await journal._tick()  # blocks 1-4 logged on the node only (the spill period has not passed)
    assert journal.stats.entries == 1 and journal.stats.node_blocks == 5
    assert (root / "s1" / "llama-1.g3.log").stat().st_size > 4 * BLOCK
    # killed: no save. The next pod on this node restores block 0 from the store and blocks 1-4 from the log
    other = await resume(store, root, "llama-2", "llama-1", 3)
    assert other.tokens("s1") == 5 * BT  # 7 positions to recompute: less than a block
    for index, block in enumerate(other.blocks("s1")):
        assert np.array_equal(np.asarray(block).reshape(-1), block_content("s1", index, BLOCK)), index
    # the node lost instead: the store alone, 4 blocks more to recompute
    alone = make_agent(store, pod="llama-3")
    assert (await alone.restore("s1", generation=4)).manifest.token_count == BT


async def test_the_store_gets_the_blocks_every_spill_period_and_the_log_goes_once_that_is_recorded(
    tmp_path: Path,
) -> None:
    store = FileStore(tmp_path / "store")
    root = tmp_path / "node"
    agent = make_agent(store)
    agent.register_session("s1", generation=1)
    clock = Clock()
    recorded: list[str] = []
    answers: list[set[str] | None] = []

    async def record(report: SaveReport) -> set[str] | None:
        ids = await recorder(recorded)(report)
        return None if answers and answers.pop(0) is None else ids

    tier = NodeTier(root, "llama-1")
    journal = KvJournal(agent, 1.0, record, node=tier, spill_s=10.0, clock=clock)
    decode(agent, "s1", BT)
    await journal._tick()
    decode(agent, "s1", 4 * BT)
    for _ in range(5):
        clock.now += 1.0
        await journal._tick()
    assert journal.stats.entries == 1 and tier.bytes_held > 0
    clock.now += 10.0
    answers.append(None)  # the checkpoint service does not answer: the log stays
    decode(agent, "s1", 5 * BT)
    await journal._tick()
    assert journal.stats.entries == 2 and tier.path("s1", "llama-1", 1).exists()
    clock.now += 10.0
    decode(agent, "s1", 6 * BT)
    await journal._tick()  # recorded this time: the log goes, the next block logged is the one after the store's
    assert journal.stats.entries == 3 and not tier.path("s1", "llama-1", 1).exists() and tier.bytes_held == 0
    assert tier.next_block("s1", 1) == 6
    newest = await store.manifest("s1", (await store.checkpoints("s1"))[0])
    assert newest.token_count == 6 * BT


async def test_the_nodes_byte_budget_sends_the_largest_logs_to_the_store_early(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    root = tmp_path / "node"
    agent = make_agent(store)
    clock = Clock()
    tier = NodeTier(root, "llama-1", budget_bytes=6 * BLOCK)
    journal = KvJournal(agent, 1.0, recorder([]), node=tier, spill_s=3600.0, clock=clock)
    for sid in ("s1", "s2"):
        agent.register_session(sid, generation=1)
        decode(agent, sid, BT)
    await journal._tick()  # both new: in the store at once
    assert journal.stats.entries == 2 and tier.bytes_held == 0
    # another pod of the node holds 3 blocks' worth already
    (root / ".usage").mkdir(parents=True, exist_ok=True)
    (root / ".usage" / "llama-9").write_text(str(3 * BLOCK))
    decode(agent, "s1", 4 * BT)  # 3 blocks more: 6 on the node with the other pod's
    decode(agent, "s2", 2 * BT)  # 1 block more: 7, over the budget
    clock.now += 1.0
    await journal._tick()
    assert journal.stats.compactions == 1
    assert not tier.path("s1", "llama-1", 1).exists()  # the largest log went to the store
    assert tier.node_bytes() <= 6 * BLOCK
    newest = await store.manifest("s1", (await store.checkpoints("s1"))[0])
    assert newest.token_count == 4 * BT


async def test_a_log_is_read_only_as_far_as_it_is_right(tmp_path: Path) -> None:
    root = tmp_path / "node"
    tier = NodeTier(root, "llama-1")
    blocks = [block_content("s1", i, BLOCK) for i in range(4)]
    digests = [digest(b) for b in blocks]
    await tier.append([("s1", 2, 0, [(memoryview(b), d) for b, d in zip(blocks, digests, strict=True)])])
    reader = NodeTier(root, "llama-2")
    whole = await reader.read_tail("s1", "llama-1", 2, digests[:1], BLOCK)
    assert [bytes(b) for b in whole.blocks] == [bytes(b) for b in blocks[1:]] and whole.start == 1
    # another generation's, another pod's: nothing
    assert (await reader.read_tail("s1", "llama-1", 1, digests[:1], BLOCK)).blocks == []
    assert (await reader.read_tail("s1", "llama-7", 2, digests[:1], BLOCK)).blocks == []
    # a checkpoint of another history (its block 0 differs): passed over, said why
    other = await reader.read_tail("s1", "llama-1", 2, [digest(block_content("x", 0, BLOCK))], BLOCK)
    assert other.blocks == [] and "another history" in other.why_not
    path = tier.path("s1", "llama-1", 2)
    record = HEADER.size + BLOCK
    # the pod died while writing its last record: the log ends before it
    os.truncate(path, 4 * record - 100)
    cut = await reader.read_tail("s1", "llama-1", 2, digests[:1], BLOCK)
    assert len(cut.blocks) == 2 and cut.why_not == ""
    # a byte flipped in block 2: blocks 1 only, and why
    data = bytearray(path.read_bytes())
    data[2 * record + HEADER.size + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    damaged = await reader.read_tail("s1", "llama-1", 2, digests[:1], BLOCK)
    assert len(damaged.blocks) == 1 and "digest" in damaged.why_not


async def test_an_encrypted_log_needs_the_pods_key(tmp_path: Path) -> None:
    root = tmp_path / "node"
    cipher = ChunkCipher(os.urandom(32), "k1")
    tier = NodeTier(root, "llama-1", cipher=cipher)
    block = block_content("s1", 0, BLOCK)
    await tier.append([("s1", 1, 0, [(memoryview(block), digest(block))])])
    assert bytes(block[:64]) not in tier.path("s1", "llama-1", 1).read_bytes()
    keyed = await NodeTier(root, "llama-2", cipher=cipher).read_tail("s1", "llama-1", 1, [], BLOCK)
    assert [bytes(b) for b in keyed.blocks] == [bytes(block)]
    keyless = await NodeTier(root, "llama-2").read_tail("s1", "llama-1", 1, [], BLOCK)
    assert keyless.blocks == [] and "no key" in keyless.why_not


async def test_logs_no_pod_wrote_for_a_while_are_swept_and_a_session_that_leaves_takes_its_log(tmp_path: Path) -> None:
    root = tmp_path / "node"
    tier = NodeTier(root, "llama-1", keep_s=60.0)
    block = block_content("s1", 0, BLOCK)
    await tier.append([(sid, 1, 0, [(memoryview(block), digest(block))]) for sid in ("s1", "s2")])
    old = time.time() - 120
    os.utime(tier.path("s1", "llama-1", 1), (old, old))
    assert tier.sweep() == 0  # its own logs are this pod's to delete
    assert NodeTier(root, "llama-2", keep_s=60.0).sweep() == 1 and not tier.path("s1", "llama-1", 1).exists()
    tier.forget("s1")
    tier.forget("s2")
    assert not tier.path("s2", "llama-1", 1).exists() and tier.bytes_held == 0


def test_the_node_tier_settings() -> None:
    settings = journal_settings({"GPUWARDEN_KV_NODE_DIR": "/var/lib/gpuwarden/journal"})
    assert settings.spill_s == 10.0 and settings.node_budget_mib == 4096
    tier = node_tier_of(settings, "llama-1")
    assert tier is not None and tier.budget_bytes == 4096 * 1024 * 1024
    assert node_tier_of(journal_settings({}), "llama-1") is None
    options = journal_options(
        make_agent(FileStore("/nonexistent-unused")),
        {"GPUWARDEN_KV_JOURNAL_S": "0.5", "GPUWARDEN_KV_NODE_DIR": "/node", "GPUWARDEN_KV_JOURNAL_SPILL_S": "30"},
    )
    assert options["journal_s"] == 0.5 and options["spill_s"] == 30.0
    assert options["node_tier"].root == Path("/node") and options["node_tier"].pod == "llama-1"
    with pytest.raises(SettingsError):
        journal_settings({"GPUWARDEN_KV_JOURNAL_SPILL_S": "0"})
    with pytest.raises(ValueError, match="spill period"):
        KvJournal(make_agent(FileStore("/nonexistent-unused")), 5.0, node=tier, spill_s=1.0)
