"""Retention and pack garbage collection: pure rules with properties, then the service applying them to a store."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.retention import CheckpointRecord, RetentionPolicy, expired, unreferenced_packs
from services.checkpoint.service import CheckpointService
from shared.host.runner import start_service
from shared.kv.filestore import FileStore
from shared.kv.manifest import checkpoint_order
from shared.plumbing.settings import Settings
from shared.wiring import Wiring
from tests.kvkit import fill, make_agent

records = st.lists(
    st.builds(
        CheckpointRecord,
        session_id=st.sampled_from(["a", "b", "c"]),
        checkpoint_id=st.text("0123456789", min_size=6, max_size=6),
        created_at=st.floats(0, 1000),
        packs=st.frozensets(st.sampled_from(["p1", "p2", "p3", "p4"]), max_size=3),
    ),
    max_size=25,
    unique_by=lambda r: r.checkpoint_id,
)


@given(
    records,
    st.integers(1, 4),
    st.floats(1, 2000),
    st.integers(0, 5000),
)
def test_newest_checkpoint_of_every_session_is_never_expired(
    recs: list[CheckpointRecord], keep: int, max_age: float, budget: int
) -> None:
    sizes = {"p1": 1000, "p2": 2000, "p3": 500, "p4": 10}
    doomed = expired(recs, RetentionPolicy(keep, max_age, budget), sizes, now=1500.0)
    doomed_ids = {r.checkpoint_id for r in doomed}
    for session in {r.session_id for r in recs}:
        newest = max((r for r in recs if r.session_id == session), key=lambda r: r.checkpoint_id)
        assert newest.checkpoint_id not in doomed_ids
        kept = [r for r in recs if r.session_id == session and r.checkpoint_id not in doomed_ids]
        assert len(kept) <= max(keep, 1)


@given(records, st.floats(0, 100))
def test_referenced_or_young_packs_are_never_collected(recs: list[CheckpointRecord], grace: float) -> None:
    ages = {"p1": 0.0, "p2": 50.0, "p3": 99.0, "p4": 100.0, "p5": 10.0}
    garbage = unreferenced_packs(ages, recs, now=100.0, grace_s=grace)
    referenced = set().union(*(r.packs for r in recs)) if recs else set()
    for pack in garbage:
        assert pack not in referenced
        assert 100.0 - ages[pack] > grace


async def test_service_applies_retention_and_collects_unreferenced_packs(settings: Settings, tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    agent = make_agent(store)
    blocks = fill(agent, "s1", 3)
    for generation in range(4):
        blocks[0][:] = generation  # a changed block per save: each save writes a new pack
        agent.update_block("s1", 0)
        await agent.save()
    assert len(await store.checkpoints("s1")) == 4
    assert len(await store.packs()) == 4
    service = CheckpointService(CheckpointSettings(gc_interval_s=0, gc_grace_s=0), store=store)
    running = await start_service(service, settings, Wiring)
    try:
        deleted, packs = await service.retention.collect_garbage(now=None)
        assert deleted == 2  # keep_per_session defaults to 2
        remaining = await store.checkpoints("s1")
        assert len(remaining) == 2
        # the oldest pack holds blocks 1 and 2, which the kept checkpoints still reference
        assert packs == 1 and len(await store.packs()) == 3
        restored = await make_agent(store, pod="p2").restore("s1")
        assert bytes(restored.blocks[0]) == bytes([3]) * len(restored.blocks[0])
    finally:
        await running.stop(grace=1)


async def _saved(store: FileStore, session_ids: list[str], saves: int) -> None:
    """Each session saved ``saves`` times by one agent, a changed block each time (a new pack per save)."""
    agent = make_agent(store)
    blocks = {sid: fill(agent, sid, 2) for sid in session_ids}
    for generation in range(saves):
        for sid in session_ids:
            blocks[sid][0][:] = generation
            agent.update_block(sid, 0)
        await agent.save()


async def test_a_turn_holds_the_sessions_that_changed_to_the_policy_without_walking_the_store(
    settings: Settings, tmp_path: Path
) -> None:
    store = FileStore(tmp_path / "store")
    await _saved(store, ["s1", "s2"], 4)
    service = CheckpointService(CheckpointSettings(gc_interval_s=0, gc_grace_s=0), store=store)
    running = await start_service(service, settings, Wiring)
    try:
        registry = service.retention.replica.registry
        manifests = [await store.manifest("s1", cid) for cid in await store.checkpoints("s1")]
        assert (await registry.repair_checkpoints("s1", manifests, store.url)).added  # recorded: s1 changed, s2 did not
        deleted, packs = await service.retention.turn(walk_sessions=0)
        assert (deleted, packs) == (2, 0)
        newest_two = sorted(cid for cid, _ in zip(await store.checkpoints("s1"), range(2), strict=False))
        assert len(await store.checkpoints("s1")) == 2
        assert sorted(str(r["checkpoint_id"]) for r in await registry.checkpoints("s1")) == newest_two
        assert len(await store.checkpoints("s2")) == 4  # not changed, not walked: untouched this turn
        # the second newest was indexed by age: past max_age_s it goes, the newest never does
        deleted, _ = await service.retention.turn(now=time.time() + 8 * 24 * 3600, walk_sessions=0)
        assert deleted == 1
        assert await store.checkpoints("s1") == [max(newest_two, key=checkpoint_order)]
        assert len(await registry.checkpoints("s1")) == 1
    finally:
        await running.stop(grace=1)


async def test_the_store_walk_goes_round_in_slices_and_collects_packs_only_at_its_end(
    settings: Settings, tmp_path: Path
) -> None:
    store = FileStore(tmp_path / "store")
    await _saved(store, ["s1", "s2", "s3"], 4)  # one pack a round; the second round's is garbage once kept 2 a session
    service = CheckpointService(CheckpointSettings(gc_interval_s=0, gc_grace_s=0, gc_walk_sessions=1), store=store)
    running = await start_service(service, settings, Wiring)
    try:
        packs_before = {p.pack_id for p in await store.packs()}
        assert await service.retention.turn() == (2, 0)  # s1 walked: its two oldest go, no pack yet
        assert [len(await store.checkpoints(s)) for s in ("s1", "s2", "s3")] == [2, 4, 4]
        await _saved(store, ["late"], 1)  # a session saved after the walk began: its pack is younger than the cutoff
        late_packs = {p.pack_id for p in await store.packs()} - packs_before
        # a file's mtime comes from the kernel's coarse clock, which may lag time.time() (the walk's cutoff) by a
        # tick: the late pack is stamped with a time read after the walk began, so it is after the cutoff for sure
        after_cutoff = time.time_ns()
        for pack_id in late_packs:
            os.utime(store.packs_dir / f"{pack_id}.pack", ns=(after_cutoff, after_cutoff))
        assert await service.retention.turn() == (2, 0)
        deleted, packs = await service.retention.turn()  # s3, and the walk's end: the second round's pack goes
        assert (deleted, packs) == (2, 1)
        left = {p.pack_id for p in await store.packs()}
        assert late_packs <= left  # not referenced by anything the walk saw, but younger than its cutoff
        for sid in ("s1", "s2", "s3", "late"):
            restored = await make_agent(store, pod="p2").restore(sid)
            assert restored.blocks
    finally:
        await running.stop(grace=1)


async def test_a_doomed_checkpoint_that_became_the_newest_is_kept(settings: Settings, tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    await _saved(store, ["s1"], 2)
    service = CheckpointService(CheckpointSettings(gc_interval_s=0), store=store)
    running = await start_service(service, settings, Wiring)
    try:
        registry = service.retention.replica.registry
        older, newest = sorted(await store.checkpoints("s1"), key=checkpoint_order)
        await registry.repair_checkpoints("s1", [await store.manifest("s1", c) for c in (older, newest)], store.url)
        await service.retention.turn(walk_sessions=0)  # the older one is indexed by age
        await registry.forget_checkpoint("s1", newest)  # as a restore forgets a corrupt newest
        assert await registry.retire_older("s1", older) is False
        deleted, _ = await service.retention.turn(now=time.time() + 8 * 24 * 3600, walk_sessions=0)
        assert deleted == 0
        assert [str(r["checkpoint_id"]) for r in await registry.checkpoints("s1")] == [older]
        assert older in await store.checkpoints("s1")
    finally:
        await running.stop(grace=1)
