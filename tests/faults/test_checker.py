"""The judge judged: the invariant checker fails where a scenario's outcome is wrong, and on a walk that found
nothing. Each test breaks one thing the checker promises (tests/faults/checker.py) and sees it say so; the same
mesh, unbroken, passes."""

from __future__ import annotations

import pytest

from services.checkpoint.audit import RegistryAudit
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.kv.crypto import ChunkCipher
from tests.faults.checker import check_invariants
from tests.faults.conftest import Mesh, expected
from tests.helpers import eventually
from tests.kvkit import flip_byte


async def saved(mesh: Mesh, sessions: list[str], blocks: int = 3) -> list[str]:
    """A pod holding ``sessions``, each saved once by a periodic turn; their checkpoint ids."""
    await mesh.add_pod("llama-1", "node-1", sessions, blocks=blocks)
    assert await mesh.periodic_turn() == 1
    return [str((await mesh.service.registry.checkpoints(sid))[0]["checkpoint_id"]) for sid in sessions]


async def problems(mesh: Mesh, min_checkpoints: int, **kwargs: object) -> list[str]:
    kwargs.setdefault("verdicts", mesh.verdicts)
    kwargs.setdefault("ciphers", [mesh.cipher] if mesh.cipher is not None else [])
    found = await check_invariants(
        mesh.store,
        mesh.client,
        mesh.subjects,
        min_checkpoints=min_checkpoints,
        **kwargs,  # type: ignore[arg-type]
    )
    return found.problems


async def test_an_empty_store_fails_a_scenario_that_made_checkpoints(mesh: Mesh) -> None:
    await mesh.add_pod("llama-1", "node-1", ["s1"])  # a pod, sessions, no save
    assert await problems(mesh, 0) == []
    (problem,) = await problems(mesh, 1)
    assert "found 0 recorded checkpoint(s)" in problem


async def test_a_store_the_registry_lost_track_of_fails_though_the_audit_lists_nothing(mesh: Mesh) -> None:
    """The checker walks the store itself: with every checkpoint record gone from Redis, the registry's own audit
    lists no session, and the store's checkpoints are each a problem (a restore would take them)."""
    ids = await saved(mesh, ["s1", "s2"])
    await mesh.check(min_checkpoints=2)
    for sid, cid in zip(["s1", "s2"], ids, strict=True):
        await mesh.service.registry.forget_checkpoint(sid, cid)
    assert [s async for s in RegistryAudit(mesh.client, mesh.subjects).checkpointed_sessions()] == []
    found = await problems(mesh, 0)
    assert len(found) == 2 and all("the registry lost it" in p for p in found), found
    assert await problems(mesh, 0, unrecorded=["s1", "s2"]) == []  # a scenario that says Redis lost them


async def test_a_checkpoint_only_the_store_holds_passes_when_older_than_the_recorded_or_stale(mesh: Mesh) -> None:
    """Retention's lag (an older checkpoint whose record went first) is no problem; nor is a stale save not deleted
    yet (the old holder's, of its older generation, after the new holder's claim sealed the store: the seal fence);
    the new holder's newest, committed and never recorded, is."""
    old = await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=3)
    assert await mesh.periodic_turn() == 1
    old.grow("s1", 1)
    assert await mesh.periodic_turn() == 1
    newer, older = (str(r["checkpoint_id"]) for r in await mesh.service.registry.checkpoints("s1"))
    await mesh.service.registry.forget_checkpoint("s1", older)
    await mesh.check(min_checkpoints=1)
    await mesh.evict(old)
    new = await mesh.add_pod("llama-2", "node-2")
    assert (await new.endpoint.restore("s1")).manifest.checkpoint_id == newer  # generation 2, sealed at `newer`
    old.grow("s1", 1)
    (stale,) = (await old.agent.save()).committed  # the old holder saves on, straight to the store
    assert stale.generation == 1 and stale.checkpoint_id > newer
    found = await mesh.check(min_checkpoints=1)
    assert found.fenced == 1 and found.store_only == 2
    new.grow("s1", 1)
    (lost,) = (await new.agent.save()).committed  # committed, its report lost
    (problem,) = await problems(mesh, 1)
    assert lost.checkpoint_id in problem and "the registry lost it" in problem


async def test_an_encrypted_checkpoint_is_decrypted_and_a_flipped_chunk_fails(encrypted_mesh: Mesh) -> None:
    mesh = encrypted_mesh
    (cid,) = await saved(mesh, ["s1"])
    manifest = await mesh.store.manifest("s1", cid)
    assert mesh.cipher is not None and manifest.key_id == mesh.cipher.key_id
    found = await mesh.check(min_checkpoints=1)
    assert found.encrypted == 1
    # without the key it proves nothing, and says so
    (problem,) = [p for p in await problems(mesh, 1, ciphers=[]) if cid in p]
    assert "not given" in problem
    # another key of the same id: nothing opens
    wrong = ChunkCipher(b"\x01" * 32, manifest.key_id)
    assert any(cid in p and "do not verify" in p for p in await problems(mesh, 1, ciphers=[wrong]))
    # one byte of one encrypted chunk flipped in its pack
    flip_byte(mesh.store, manifest.blocks[1].pack, manifest.blocks[1].offset + 3)
    found_now = await problems(mesh, 1)
    assert any(cid in p and "blocks [1] do not verify" in p for p in found_now), found_now
    assert any("found 0 recorded checkpoint(s)" in p for p in found_now)
    assert await problems(mesh, 0, corrupted=[cid]) == []  # damaged on purpose: expected to fail


async def test_a_checkpoint_damaged_on_purpose_that_still_restores_is_a_problem(mesh: Mesh) -> None:
    (cid,) = await saved(mesh, ["s1"])
    (problem,) = await problems(mesh, 0, corrupted=[cid])
    assert cid in problem and "damaged on purpose and restores cleanly" in problem
    manifest = await mesh.store.manifest("s1", cid)
    flip_byte(mesh.store, manifest.blocks[0].pack, manifest.blocks[0].offset)
    assert await problems(mesh, 0, corrupted=[cid]) == []
    assert any(cid in p and "does not restore" in p for p in await problems(mesh, 0))


async def test_a_second_verdict_for_one_drain_id_is_a_problem(mesh: Mesh) -> None:
    await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="d1", deadline_s=10))
    first = await eventually(lambda: next((v for v in mesh.verdicts if v.drain_id == "d1"), None))
    assert isinstance(first, DrainCompleted)
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="d1", deadline_s=10))  # answered again: the same
    await eventually(lambda: len([v for v in mesh.verdicts if v.drain_id == "d1"]) == 2)
    await mesh.check(min_checkpoints=1, drains=["d1"])
    # a second, different verdict for the same drain, as a replica that ran it again would publish
    await mesh.bus.publish(DrainFailed(node="node-1", drain_id="d1", reason="ran it again"))
    await eventually(lambda: len([v for v in mesh.verdicts if v.drain_id == "d1"]) == 3)
    found = await problems(mesh, 1, drains=["d1"])
    assert any("drain d1 has 2 different verdicts" in p for p in found), found


@pytest.mark.parametrize("kind", ["completed", "failed"])
async def test_a_verdict_published_that_is_not_the_recorded_one_is_a_problem(mesh: Mesh, kind: str) -> None:
    await mesh.add_pod("llama-1", "node-1", ["s1"], blocks=2)
    await mesh.bus.publish(DrainRequested(node="node-1", drain_id="d1", deadline_s=10))
    await eventually(lambda: any(v.drain_id == "d1" for v in mesh.verdicts))
    recorded = next(v for v in mesh.verdicts if v.drain_id == "d1")
    other = (
        DrainCompleted(node="node-1", drain_id="d1", sessions_committed=99)
        if kind == "completed"
        else DrainFailed(node="node-1", drain_id="d1", reason="no")
    )
    found = await problems(mesh, 1, drains=["d1"], verdicts=[other])
    assert any("not the one recorded" in p for p in found), found
    assert await problems(mesh, 1, drains=["d1"], verdicts=[recorded]) == []
    assert [bytes(b) for b in mesh.pods[0].agent.blocks("s1")] == expected("s1", 2)
