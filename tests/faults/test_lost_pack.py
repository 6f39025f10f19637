"""A pack the store lost never wedges the sessions that build on it: the next save writes those blocks again.

The old way: one pack that seven sessions' newest checkpoints referenced was deleted from the NATS object store;
the next drain failed honestly ("pack ... missing", nothing evicted), and so did every later one, because
each save built on blocks whose pack was gone and never wrote them again. Both stores, both moments: a pack lost
between drains (the next drain completes at once) and one lost while a drain saves (that drain fails honestly,
the next completes). The checkpoints recorded before the loss are damaged by the test, and the checker expects
exactly those not to restore."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from shared.contract.checkpoint import SaveSessions, SaveSessionsReport
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.subjects import Subjects
from shared.kv.filestore import FileStore
from shared.kv.manifest import CheckpointManifest
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from tests.faults.conftest import Mesh, Pod, expected, open_mesh
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(120)

SESSIONS = [f"s{i}" for i in range(7)]


class LosingStore:
    """The mesh's store (the service's and the agents'), which loses a pack on cue: ``lose_at_commit`` deletes
    it just as the next save commits its manifests, after the agent looked at what its sessions build on and
    before the checkpoint service verifies the report."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lose_at_commit = ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def commit_manifests(self, manifests: Sequence[CheckpointManifest]) -> None:
        if self.lose_at_commit:
            pack, self.lose_at_commit = self.lose_at_commit, ""
            await self.inner.delete_pack(pack)
        await self.inner.commit_manifests(manifests)


@pytest.fixture(params=["file", "nats"])
async def lossy(
    request: pytest.FixtureRequest, settings: Settings, subjects: Subjects, tmp_path: Path, bus: Bus
) -> AsyncIterator[Mesh]:
    """The checkpoint mesh on a ``LosingStore`` over the file store or the NATS object store."""
    if request.param == "file":
        inner: Any = FileStore(tmp_path / "store")
    else:
        from shared.kv.objstore import NatsObjectStore

        inner = NatsObjectStore(bus.nc, f"{subjects.root}-ckpt")
    store = LosingStore(inner)
    try:
        async with open_mesh(settings, subjects, store, bus) as m:  # type: ignore[arg-type]
            yield m
    finally:
        if request.param == "nats":
            with contextlib.suppress(Exception):
                await bus.nc.jetstream().delete_object_store(f"{subjects.root}-ckpt")


async def saved_twice(mesh: Mesh) -> tuple[Pod, str, list[str]]:
    """Seven sessions saved in one periodic round (one pack), then grown by a block and saved again: each newest
    checkpoint references that pack. Returns the pod, the pack and every checkpoint recorded so far."""
    pod = await mesh.add_pod("llama-1", "node-1", SESSIONS, blocks=3)
    assert await mesh.periodic_turn() == 1
    for sid in SESSIONS:
        pod.grow(sid, 1)
    assert await mesh.periodic_turn() == 1
    recorded: list[str] = []
    packs: set[str] = set()
    for sid in SESSIONS:
        checkpoints = [str(r["checkpoint_id"]) for r in await mesh.service.registry.checkpoints(sid)]
        assert len(checkpoints) == 2
        recorded += checkpoints
        packs.add((await mesh.store.manifest(sid, checkpoints[0])).blocks[0].pack)
    (pack,) = packs  # the first round's pack, under every session's newest checkpoint
    return pod, pack, recorded


async def drain(mesh: Mesh, drain_id: str) -> DrainCompleted | DrainFailed:
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id=drain_id, deadline_s=20))
    return await eventually(lambda: next((v for v in mesh.verdicts if v.drain_id == drain_id), None), timeout=30)


async def restored_elsewhere(mesh: Mesh, pod: Pod) -> None:
    """The drained pod goes; another pod restores every session from its newest checkpoint, verified."""
    await mesh.evict(pod)
    other = await mesh.add_pod("llama-2", "node-2")
    for sid in SESSIONS:
        restored = await other.endpoint.restore(sid)
        assert restored.fell_back_from == [], restored.fell_back_from
        assert [bytes(b) for b in restored.blocks] == expected(sid, 4)


async def test_a_pack_lost_between_drains_is_written_again_by_the_next_drain(lossy: Mesh) -> None:
    pod, pack, damaged = await saved_twice(lossy)
    await lossy.store.delete_pack(pack)
    verdict = await drain(lossy, "d1")
    assert isinstance(verdict, DrainCompleted) and verdict.sessions_committed == len(SESSIONS), verdict
    for sid in SESSIONS:
        newest = str((await lossy.service.registry.checkpoints(sid))[0]["checkpoint_id"])
        manifest = await lossy.store.manifest(sid, newest)
        assert manifest.bytes_written == 3 * len(expected(sid, 1)[0])  # the three blocks of the lost pack
    await restored_elsewhere(lossy, pod)
    await lossy.check(min_checkpoints=7, drains=["d1"], corrupted=damaged)


async def test_a_pack_lost_during_a_drain_fails_it_honestly_and_the_next_drain_completes(lossy: Mesh) -> None:
    pod, pack, damaged = await saved_twice(lossy)
    lossy.store.lose_at_commit = pack  # type: ignore[attr-defined]
    failed = await drain(lossy, "d1")
    assert isinstance(failed, DrainFailed), failed
    assert {f.session_id for f in failed.failed_sessions} == set(SESSIONS)
    assert all(f"pack {pack} missing" in f.reason for f in failed.failed_sessions)
    completed = await drain(lossy, "d2")
    assert isinstance(completed, DrainCompleted) and completed.sessions_committed == len(SESSIONS), completed
    await restored_elsewhere(lossy, pod)
    await lossy.check(min_checkpoints=7, drains=["d1", "d2"], corrupted=damaged)


async def test_a_save_command_naming_sessions_to_rewrite_writes_them_whole(mesh: Mesh) -> None:
    """``SaveSessions.rewrite`` (the checkpoint service's scrub found a pack rotten): those sessions write every
    block again, even in a periodic save that finds them unchanged; the others write nothing."""
    pod = await mesh.add_pod("llama-1", "node-1", ["s1", "s2"], blocks=3)
    assert await mesh.periodic_turn() == 1
    command = SaveSessions(pod=pod.name, reason="periodic", changed_only=True, rewrite=["s1"])
    report = await mesh.bus.request(mesh.subjects.for_event(command), command, timeout=10)
    assert isinstance(report, SaveSessionsReport), report
    assert report.unchanged == 1 and not report.failed
    (rewritten,) = report.committed
    assert rewritten.session_id == "s1" and rewritten.bytes_written == rewritten.bytes_total > 0
