"""The scrub reconciles the registry with the store: a rule with a property, then the service on real Redis, NATS and
a file store in tmp_path, whose files the tests delete or damage as a disk, an operator or a bucket purge would."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.contract.checkpoint import (
    AgentSessions,
    CheckpointForgotten,
    LocateCheckpoint,
    SaveSessions,
    SaveSessionsReport,
)
from shared.host.runner import RunningService, start_service
from shared.kv.agent import KvAgent
from shared.kv.filestore import FileStore
from shared.kv.manifest import CheckpointManifest, ChunkRef, lost_pack
from shared.kv.reports import report_event
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from shared.wiring import Wiring
from tests.helpers import eventually
from tests.kvkit import LAYOUT, block_content, fill, flip_byte, make_agent

POD = "llama-1"


def _manifest(blocks: list[tuple[str, int, int]]) -> CheckpointManifest:
    return CheckpointManifest(
        checkpoint_id="g0000000001-s0000000001-000000000000",
        session_id="s",
        namespace="llm",
        deployment="llama",
        pod=POD,
        node="node-1",
        layout=LAYOUT,
        token_count=0,
        blocks=[ChunkRef(digest="d", size=n, pack=p, offset=o, length=n) for p, o, n in blocks],
        created_at=datetime.now(UTC),
    )


@given(
    st.lists(st.tuples(st.sampled_from(["p1", "p2", "p3"]), st.integers(0, 100), st.integers(1, 50)), max_size=8),
    st.dictionaries(st.sampled_from(["p1", "p2", "p3"]), st.integers(0, 200)),
)
def test_a_manifest_is_whole_exactly_when_every_block_ends_within_a_present_pack(
    blocks: list[tuple[str, int, int]], sizes: dict[str, int]
) -> None:
    problem = lost_pack(_manifest(blocks), sizes)
    whole = all(p in sizes and sizes[p] >= o + n for p, o, n in blocks)
    assert (problem == "") == whole, (problem, blocks, sizes)
    if not whole:
        assert problem.startswith("pack ")


@dataclass
class Scene:
    service: CheckpointService
    store: FileStore
    agent: KvAgent
    forgotten: list[CheckpointForgotten]

    async def save(self, sessions: list[str]) -> None:
        """The pod saves these sessions (one pack for them) and the service records what it reports."""
        report = await self.agent.save(sessions)
        recorded = await self.service.saves.record(report_event(self.agent, report), "")
        assert recorded.committed == set(sessions), recorded.failed

    async def recorded(self, sid: str) -> list[str]:
        return [str(r["checkpoint_id"]) for r in await self.service.registry.checkpoints(sid, limit=100)]

    def files(self) -> set[str]:
        return {str(p.relative_to(self.store.root)) for p in Path(self.store.root).rglob("*") if p.is_file()}


@contextlib.asynccontextmanager
async def scene(settings: Settings, bus: Bus, tmp_path: Path, **changes: float) -> AsyncIterator[Scene]:
    store = FileStore(tmp_path / "store")
    service = CheckpointService(
        CheckpointSettings(**{"gc_interval_s": 0, "scrub_interval_s": 0, **changes}),  # type: ignore[arg-type]
        store=store,
    )
    running: RunningService = await start_service(service, settings, Wiring)
    forgotten: list[CheckpointForgotten] = []

    async def on_forgotten(event: CheckpointForgotten) -> None:
        forgotten.append(event)

    await bus.subscribe(running.ctx.subjects.pattern("checkpoint.forgotten"), on_forgotten, (CheckpointForgotten,))
    try:
        yield Scene(service, store, make_agent(store, pod=POD), forgotten)
    finally:
        await running.stop(grace=1)


async def _placed(s: Scene, sessions: list[str]) -> None:
    """The pod announces the sessions: the registry has it hold them."""
    applied = await s.service.registry.apply_announcement(AgentSessions(pod=POD, node="node-1", sessions=sessions))
    assert not applied.stale


async def _two_checkpoints_each(s: Scene, sessions: list[str]) -> dict[str, list[str]]:
    """Each session saved twice, alone (its own packs), a block changed between: newest first."""
    for sid in sessions:
        blocks = fill(s.agent, sid, 3)
        await s.save([sid])
        blocks[0][:] = 7
        s.agent.update_block(sid, 0)
        await s.save([sid])
    await _placed(s, sessions)
    return {sid: await s.recorded(sid) for sid in sessions}


async def test_a_walk_forgets_what_the_store_lost_marks_the_holder_and_leaves_the_rest(
    settings: Settings, bus: Bus, tmp_path: Path
) -> None:
    """Four sessions of two checkpoints each: s1's newest manifest deleted, the pack only s2's newest references
    deleted, s3 untouched, s4's second block rotten (both checkpoints reference it). The walk forgets s1's newest
    (manifest), s2's newest (pack) and s4's older (rot) with one event each; s4's newest stands (its files stand,
    rotten or not) and s3 is untouched; s1, s2 and s4 are marked for a full next save; not a file is deleted."""
    async with scene(settings, bus, tmp_path) as s:
        ids = await _two_checkpoints_each(s, ["s1", "s2", "s3", "s4"])
        assert all(len(v) == 2 for v in ids.values())
        os.unlink(s.store.sessions_dir / "s1" / f"{ids['s1'][0]}.json")
        older_s2 = await s.store.manifest("s2", ids["s2"][1])
        newest_s2 = await s.store.manifest("s2", ids["s2"][0])
        gone = newest_s2.packs - older_s2.packs  # the pack of the block that changed
        assert len(gone) == 1
        os.unlink(s.store.packs_dir / f"{next(iter(gone))}.pack")
        rotten = (await s.store.manifest("s4", ids["s4"][0])).blocks[1]  # unchanged: both checkpoints reference it
        flip_byte(s.store, rotten.pack, rotten.offset + 5)
        files = s.files()

        walked = await s.service.scrub.walk(sample_bytes=1 << 30)  # every block read back

        assert walked.went_round and walked.sessions == 4 and walked.checked == 8
        assert await s.recorded("s1") == [ids["s1"][1]]
        assert await s.recorded("s2") == [ids["s2"][1]]
        assert await s.recorded("s3") == ids["s3"]
        assert await s.recorded("s4") == [ids["s4"][0]]
        await eventually(lambda: len(s.forgotten) == 3)
        by_session = {e.session_id: e for e in s.forgotten}
        assert {sid: (e.checkpoint_id, e.reason, e.newest, e.pod) for sid, e in by_session.items()} == {
            "s1": (ids["s1"][0], "manifest", True, POD),
            "s2": (ids["s2"][0], "pack", True, POD),
            "s4": (ids["s4"][1], "rot", False, POD),
        }
        assert await s.service.registry.rewrites(POD) == {"s1", "s2", "s4"}
        assert s.files() == files  # the scrub never deletes
        located = await s.service.restores.on_locate(LocateCheckpoint(session_id="s2", pod=POD, node="node-1"))
        assert located.candidates[0] == ids["s2"][0] and not located.from_store  # offered, not recorded again
        assert await s.recorded("s2") == [ids["s2"][1]]
        metrics = s.service.scrub.replica.metrics
        assert metrics.scrub_forgotten.labels("pack")._value.get() == 1
        assert metrics.scrub_checked._value.get() == 8

        again = await s.service.scrub.walk(sample_bytes=1 << 30)  # a second walk: nothing new to forget
        assert again.forgotten == 0 and again.checked == 5
        assert await s.recorded("s4") == [ids["s4"][0]]


async def test_the_newest_checkpoint_stands_while_its_files_do_and_goes_when_they_are_gone(
    settings: Settings, bus: Bus, tmp_path: Path
) -> None:
    """A session no pod holds (as an ended session's records brought back by a failover): its older checkpoint's
    manifest deleted, then every file of it. The first walk forgets only the older record (the newest's files
    stand); once they are gone too the newest goes, and the session has no record left. No pod is marked: none
    holds it."""
    async with scene(settings, bus, tmp_path) as s:
        ids = await _two_checkpoints_each(s, ["s1"])
        await s.service.registry.forget_pod(POD)
        os.unlink(s.store.sessions_dir / "s1" / f"{ids['s1'][1]}.json")
        assert (await s.service.scrub.walk()).forgotten == 1
        assert await s.recorded("s1") == [ids["s1"][0]]
        for path in list(s.store.sessions_dir.rglob("*.json")) + list(s.store.packs_dir.glob("*.pack")):
            path.unlink()
        assert (await s.service.scrub.walk()).forgotten == 1
        assert await s.recorded("s1") == []
        await eventually(lambda: len(s.forgotten) == 2)
        assert [e.newest for e in s.forgotten] == [False, True] and all(e.pod == "" for e in s.forgotten)
        assert await s.service.registry.rewrites(POD) == set()


async def test_the_walk_goes_round_in_slices_and_starts_again_when_redis_changed(
    settings: Settings, bus: Bus, tmp_path: Path
) -> None:
    """A turn takes about ``scrub_sessions`` sessions; the cursor is kept in Redis between turns, and a walk kept
    for another Redis (its run id: a promotion, a restart) starts again from the beginning."""
    async with scene(settings, bus, tmp_path, scrub_sessions=2) as s:
        sessions = [f"s{i}" for i in range(12)]
        for sid in sessions:
            fill(s.agent, sid, 1)
        await s.save(sessions)
        scrub, registry = s.service.scrub, s.service.registry
        seen: list[int] = []
        first = await scrub.turn()
        assert first.restarted and not first.went_round  # no walk was kept: it starts
        seen.append(first.sessions)
        while not (turn := await scrub.turn()).went_round:
            assert not turn.restarted
            seen.append(turn.sessions)
        seen.append(turn.sessions)
        assert sum(seen) >= 12 and len(seen) >= 3  # in slices, every session at least once
        cursor, run_id = await registry.scrub_position()
        assert cursor == 0 and run_id == await registry.run_id()
        await scrub.turn()
        await registry.keep_scrub_position(123, "a-redis-that-was-promoted-away")
        restarted = await scrub.turn()
        assert restarted.restarted
        assert scrub.replica.metrics.scrub_restarts._value.get() == 1


async def test_the_scrub_loop_takes_its_turns_on_its_own(settings: Settings, bus: Bus, tmp_path: Path) -> None:
    async with scene(settings, bus, tmp_path, scrub_interval_s=0.1) as s:
        ids = await _two_checkpoints_each(s, ["s1"])
        os.unlink(s.store.sessions_dir / "s1" / f"{ids['s1'][1]}.json")
        await eventually(lambda: s.forgotten, timeout=20)
        assert await s.recorded("s1") == [ids["s1"][0]]


async def test_the_next_save_command_names_the_marked_sessions_until_a_full_save_is_recorded(
    settings: Settings, bus: Bus, tmp_path: Path
) -> None:
    """A save refused because a pack its base references is gone marks the session; every save command to its pod
    names it in ``rewrite`` (of the sessions the command names) until a save of it that wrote every block is
    recorded: an incremental one clears nothing."""
    async with scene(settings, bus, tmp_path) as s:
        await _two_checkpoints_each(s, ["s1", "s2"])
        s.agent.append_block("s1", block_content("s1", 99, LAYOUT.block_bytes).reshape(2, -1))
        report = await s.agent.save(["s1"])  # incremental: it references the earlier packs
        for pack in (await s.store.manifest("s1", report.committed[0].checkpoint_id)).packs:
            os.unlink(s.store.packs_dir / f"{pack}.pack")  # lost before the service verifies the report
        recorded = await s.service.saves.record(report_event(s.agent, report), "")
        assert not recorded.committed and "missing" in recorded.failed[0].reason
        assert await s.service.registry.rewrites(POD) == {"s1"}

        commands: list[SaveSessions] = []

        async def agent(command: SaveSessions) -> SaveSessionsReport:
            commands.append(command)
            return SaveSessionsReport(pod=POD, node="node-1")

        subject = s.service.ctx.subjects.for_event(SaveSessions(pod=POD))
        await bus.serve(subject, agent, (SaveSessions,))
        await s.service.saves.command(POD, 5.0, "periodic", changed_only=True)
        await s.service.saves.command(POD, 5.0, "drain", generations={"s2": 0})
        await s.service.saves.command(POD, 5.0, "drain", generations={"s1": 0, "s2": 0})
        assert [c.rewrite for c in commands] == [["s1"], [], ["s1"]]

        s.agent.update_block("s2", 1)
        incremental = await s.agent.save(["s2"])
        assert incremental.committed[0].bytes_written < incremental.committed[0].bytes_total
        await s.service.registry.mark_rewrite(POD, ["s2"])
        await s.service.saves.record(report_event(s.agent, incremental), "")
        assert await s.service.registry.rewrites(POD) == {"s1", "s2"}  # reused blocks: not healed

        fresh = make_agent(s.store, pod=POD)  # writes every block: what an agent honouring ``rewrite`` does
        fill(fresh, "s1", 4)
        full = await fresh.save(["s1"])
        assert (await s.service.saves.record(report_event(fresh, full), "")).committed == {"s1"}
        assert await s.service.registry.rewrites(POD) == {"s2"}
