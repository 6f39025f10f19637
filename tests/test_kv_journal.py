"""The KV journal on a real file store: each full block written once as it fills, entries that only ever grow,
a restore from the newest prefix byte for byte, a tail left to periodic saves, and a full store that pauses the
journal instead of blocking the engine."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from shared.contract.checkpoint import PERIODIC_REASON, SaveSessions, SaveSessionsReport
from shared.kv.agent import KvAgent, SaveReport
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.kv.journal import JOURNAL_REASON, KvJournal, journal_covers, journal_settings
from shared.plumbing.bus import Bus
from shared.plumbing.errors import SettingsError
from tests.kvkit import LAYOUT, block_content, make_agent, small_disk

BT = LAYOUT.block_tokens
BLOCK = LAYOUT.block_bytes


def decode(agent: KvAgent, session_id: str, tokens: int) -> list[np.ndarray]:
    """Grow the session to ``tokens`` positions the way a paged engine does: the tail block is appended when its
    first position is written and replaced in place as it fills; a full block never changes again."""
    if session_id not in agent.sessions():
        agent.register_session(session_id)
    held = agent.tokens(session_id)
    arrays: list[np.ndarray] = []
    for position in range(held, tokens):
        index = position // BT
        content = block_content(session_id, index, BLOCK)
        if index == len(agent.blocks(session_id)):
            agent.append_block(session_id, content.copy(), tokens=position + 1)
        else:
            agent.update_block(session_id, index, content.copy())
        agent.set_tokens(session_id, position + 1)
    arrays = [block_content(session_id, i, BLOCK) for i in range(-(-tokens // BT))]
    return arrays


def written(report: SaveSessionsReport) -> int:
    return sum(c.bytes_written for c in report.committed)


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


async def test_each_full_block_is_written_once_and_the_newest_prefix_restores_byte_for_byte(store: FileStore) -> None:
    agent = make_agent(store)
    journal = KvJournal(agent, 1.0)
    decode(agent, "s1", 2 * BT + 5)
    first = await journal.flush()
    assert [m.token_count for m in first.committed] == [2 * BT]  # the full blocks only: the tail may still change
    assert first.bytes_written == 2 * BLOCK and first.committed[0].reason == JOURNAL_REASON
    assert (await journal.flush()).committed == []  # nothing grew: nothing written

    decode(agent, "s1", 4 * BT + 1)
    second = await journal.flush()
    assert [m.token_count for m in second.committed] == [4 * BT]
    assert second.bytes_written == 2 * BLOCK  # the two new blocks; the first two are referenced
    assert journal.stats.bytes_written == 4 * BLOCK == journal.stats.entries * 2 * BLOCK

    other = make_agent(store, pod="llama-2")
    restored = await other.restore("s1", generation=1)
    assert restored.manifest.checkpoint_id == second.committed[0].checkpoint_id
    expected = [block_content("s1", i, BLOCK) for i in range(4)]
    assert [bytes(np.asarray(b).reshape(-1)) for b in restored.blocks] == [bytes(e) for e in expected]
    assert other.tokens("s1") == 4 * BT


async def test_an_entry_never_holds_fewer_tokens_than_the_last_checkpoint(store: FileStore) -> None:
    agent = make_agent(store)
    journal = KvJournal(agent, 1.0)
    decode(agent, "s1", 2 * BT + 9)
    full = await agent.save(["s1"], reason="periodic")
    assert full.committed[0].token_count == 2 * BT + 9
    decode(agent, "s1", 2 * BT + 12)
    assert (await journal.flush()).committed == []  # its 2 full blocks hold less than the periodic save did
    decode(agent, "s1", 3 * BT)
    grown = await journal.flush()
    assert [m.token_count for m in grown.committed] == [3 * BT]
    assert grown.committed[0].sequence > full.committed[0].sequence  # newer, and holding more
    # the periodic save's tail is full now; its bytes (here the same: this engine fills a block's bytes at once)
    # are found by digest, never by position, so only changed bytes are ever written
    assert grown.bytes_written == 0


async def test_a_periodic_save_after_the_journal_writes_only_the_tail(store: FileStore) -> None:
    agent = make_agent(store)
    journal = KvJournal(agent, 1.0)
    decode(agent, "s1", 3 * BT + 4)
    await journal.flush()
    periodic = await agent.save(["s1"], reason="periodic", changed_only=True)
    assert [m.token_count for m in periodic.committed] == [3 * BT + 4]
    assert periodic.bytes_written == BLOCK  # the tail; the full blocks are the journal's
    assert (await agent.save(["s1"], reason="periodic", changed_only=True)).unchanged == 1


async def test_while_the_journal_keeps_up_a_pods_periodic_saves_leave_the_tail_to_it(
    store: FileStore, bus: Bus
) -> None:
    """The checkpoint service's periodic save, as the pod's endpoint answers it: with the journal running it writes
    only the full blocks the journal has not flushed yet (never the tail block, which would be written again at
    every period); with the journal paused (a slow store) or off, the whole session, tail included; a drain's save
    always the whole session."""
    agent = make_agent(store)
    endpoint = AgentEndpoint(agent, bus, journal_s=3600.0)  # a journal that never flushes by itself here
    journal = endpoint.journal
    assert journal is not None and not journal_covers(journal)
    journal.start()
    try:
        assert journal_covers(journal)
        periodic = SaveSessions(pod="llama-1", reason=PERIODIC_REASON, changed_only=True)
        decode(agent, "s1", 3 * BT + 4)
        first = await endpoint.on_save(periodic)
        assert [c.token_count for c in first.committed] == [3 * BT]  # the journal had not flushed them yet
        assert written(first) == 3 * BLOCK
        decode(agent, "s1", 3 * BT + 9)
        tail_only = await endpoint.on_save(periodic)
        assert not tail_only.committed and not tail_only.failed
        rewrite = await endpoint.on_save(SaveSessions(pod="llama-1", reason=PERIODIC_REASON, rewrite=["s1"]))
        assert [c.token_count for c in rewrite.committed] == [3 * BT + 9]  # a pack lost: the whole session again

        decode(agent, "s1", 3 * BT + 12)
        journal.paused_until = journal.clock() + 60  # the store did not keep up
        assert not journal_covers(journal)
        paused = await endpoint.on_save(periodic)
        assert [c.token_count for c in paused.committed] == [3 * BT + 12]  # the tail block too
        journal.paused_until = 0.0
        decode(agent, "s1", 3 * BT + 14)
        drained = await endpoint.on_save(SaveSessions(pod="llama-1", reason="drain"))
        assert [c.token_count for c in drained.committed] == [3 * BT + 14]
    finally:
        await journal.stop()
    assert not journal_covers(journal) and not journal_covers(None)


async def test_the_journal_runs_behind_the_engine_and_stops_cleanly(store: FileStore) -> None:
    agent = make_agent(store)
    recorded: list[SaveReport] = []

    async def record(report: SaveReport) -> None:
        recorded.append(report)

    journal = KvJournal(agent, 0.05, record)
    journal.start()
    try:
        decode(agent, "s1", BT + 3)
        decode(agent, "s2", 3 * BT)
        deadline = asyncio.get_running_loop().time() + 10
        while {m.session_id for r in recorded for m in r.committed} != {"s1", "s2"}:
            assert asyncio.get_running_loop().time() < deadline, f"journal never wrote both sessions: {recorded}"
            await asyncio.sleep(0.02)
    finally:
        await journal.stop()
    assert sorted(await store.checkpoints("s1")) and sorted(await store.checkpoints("s2"))
    entries = {m.session_id: m.token_count for r in recorded for m in r.committed}
    assert entries == {"s1": BT, "s2": 3 * BT}


async def test_a_session_that_moved_is_not_journaled_under_its_old_generation(store: FileStore) -> None:
    agent = make_agent(store)
    journal = KvJournal(agent, 1.0)
    decode(agent, "s1", 2 * BT)
    agent.forget_session("s1")  # the pod lost it (preempted, or another pod took it)
    assert (await journal.flush()).committed == []
    assert await store.checkpoints("s1") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs for a real ENOSPC needs root")
async def test_a_full_store_pauses_the_journal_and_never_blocks_the_engine(tmp_path: Path) -> None:
    with small_disk(tmp_path / "tiny", "256k") as root:
        store = FileStore(root)
        agent = make_agent(store)
        now = [100.0]
        journal = KvJournal(agent, 1.0, backoff_s=30.0, clock=lambda: now[0])
        decode(agent, "s1", 2 * BT)
        assert (await journal.flush()).committed  # room for the first entry
        decode(agent, "s1", 40 * BT)  # 640 KiB of blocks: more than the disk holds
        failed = await journal.flush()
        assert failed.failed and not failed.committed
        assert journal.paused and journal.stats.paused == 1 and journal.stats.failed == 1
        decode(agent, "s1", 41 * BT)  # the engine goes on while the journal waits
        assert agent.tokens("s1") == 41 * BT
        restored = await make_agent(store, pod="llama-2").restore("s1", generation=1)
        assert restored.manifest.token_count == 2 * BT  # the last entry that was written stands
        now[0] += 31
        assert not journal.paused


def test_the_setting_is_off_by_default_and_refuses_nonsense() -> None:
    assert journal_settings({}).interval_s == 0.0
    assert journal_settings({"GPUWARDEN_KV_JOURNAL_S": "0.5"}).interval_s == 0.5
    with pytest.raises(SettingsError, match="GPUWARDEN_KV_JOURNAL_S"):
        journal_settings({"GPUWARDEN_KV_JOURNAL_S": "-1"})
    with pytest.raises(ValueError, match="interval"):
        KvJournal(make_agent(FileStore("/nonexistent-unused")), 0.0)
