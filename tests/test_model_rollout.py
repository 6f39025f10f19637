"""Model rollouts: a versioned, compare-and-set rollout document; the checkpoint service prepares every pod, then
switches the deployment's serving version at once or aborts; sessions stay on the version that built their KV
cache, and no checkpoint is ever restored into another version."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest

from shared.clients.rollouts import RolloutRefused, begin_rollout, deployment_key, read_models, settle_rollout
from shared.contract.configdocs import ModelVersions
from shared.contract.subjects import Subjects
from shared.kv.agent import KvAgent
from shared.kv.manifest import IncompatibleCheckpoint
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore, redis_client
from shared.plumbing.errors import InvalidConfig
from shared.plumbing.settings import Settings
from shared.ports.cluster import EvictionOutcome
from shared.sim.conversations import Conversations
from shared.sim.engines import engine_for
from shared.sim.spec import TINY_LLAMA
from shared.sim.workload import SimWorkload
from tests.helpers import eventually
from tests.workloadkit import SMALL_MODEL, mesh, send_rounds, spec_of, turn


async def begin_sessions(bus: Bus, workload: SimWorkload, count: int, prompt: int) -> list[str]:
    """``old-0`` .. ``old-<count-1>``, one turn each, served before anything else happens."""
    old = [f"old-{i}" for i in range(count)]
    for sid in old:
        await bus.publish(turn(sid, prompt, 4))
    await eventually(lambda: workload.stats.served >= len(old), timeout=30)
    return old


async def phase(store: ConfigStore, rollout_id: str) -> str:
    _, doc = await read_models(store)
    rollout = doc.deployments[deployment_key("llm", "llama")].rollout
    assert rollout is not None and rollout.rollout_id == rollout_id
    return rollout.phase


# -- the document -----------------------------------------------------------------------------------------------
async def test_of_two_concurrent_rollouts_exactly_one_proceeds_and_the_other_is_refused_with_a_reason(
    settings: Settings, subjects: Subjects
) -> None:
    client = redis_client(settings.redis)
    try:
        store = ConfigStore(client, subjects)
        results = await asyncio.gather(
            begin_rollout(store, "llm", "llama", "2", from_version="1", by="alice"),
            begin_rollout(store, "llm", "llama", "3", from_version="1", by="bob"),
            return_exceptions=True,
        )
        began = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, RolloutRefused)]
        assert len(began) == 1 and len(refused) == 1, results
        assert f"rollout {began[0].rollout_id}" in str(refused[0]) and "in progress" in str(refused[0])
        _, doc = await read_models(store)
        entry = doc.deployments["llm/llama"]
        assert entry.rollout == began[0] and entry.serving_version == "1"
        # settling is idempotent, and the switch flips the serving version in the same write
        settled = await settle_rollout(store, "llm", "llama", began[0].rollout_id, "switched", reason="ok")
        assert settled is not None and settled[1].serving_version == began[0].to_version
        assert await settle_rollout(store, "llm", "llama", began[0].rollout_id, "aborted") is None
        # after the switch, another rollout may begin (a rollback is one); the same version is refused
        with pytest.raises(RolloutRefused, match="already serves"):
            await begin_rollout(store, "llm", "llama", began[0].to_version)
        back = await begin_rollout(store, "llm", "llama", "1")
        assert back.from_version == began[0].to_version
    finally:
        await client.aclose()


async def test_a_rollout_document_that_does_not_validate_is_refused_naming_the_field(
    settings: Settings, subjects: Subjects
) -> None:
    client = redis_client(settings.redis)
    try:
        store = ConfigStore(client, subjects)
        with pytest.raises(RolloutRefused, match="--from"):
            await begin_rollout(store, "llm", "llama", "2")  # nothing says what it serves now
        with pytest.raises(InvalidConfig, match="min_ready"):
            await begin_rollout(store, "llm", "llama", "2", from_version="1", min_ready=0.0)
        bad = (
            b'{"deployments": {"llm/llama": {"rollout": {"rollout_id": "r", "from_version": "1", "to_version": "1"}}}}'
        )
        with pytest.raises(InvalidConfig, match="already serves"):
            await store.write_raw("models", bad, 0, "test")
        with pytest.raises(InvalidConfig, match="deployments"):
            await store.write_raw("models", b'{"deployments": {"no-slash": {}}}', 0, "test")
        assert await store.read("models") is None
        assert msgspec.json.decode(b"{}", type=ModelVersions).deployments == {}
    finally:
        await client.aclose()


# -- on the simulated cluster -------------------------------------------------------------------------------------
async def test_a_rollout_under_live_traffic_never_mixes_versions_in_a_session(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    """The real tiny Llama on two pods. Sessions begun on version 1 keep being served on it after the switch;
    sessions begun after it run on version 2 (other weights). One pod misses the switch announcement and switches
    on its next announcement. A pod is then evicted: its sessions are restored, each into the version that built
    it (verified against a reference run), and its replacement serves only version 2."""
    model = msgspec.structs.replace(TINY_LLAMA, max_model_len=512)
    spec = spec_of(2, kv_blocks=64, model=model)
    async with mesh(settings, subjects, bus, tmp_path, spec) as m:
        w = m.workload
        w.served_log = []
        store = ConfigStore(m.service.registry.client, subjects)
        old = await begin_sessions(bus, w, 6, prompt=20)
        assert set(w.stats.served_by_version) == {"1"}

        deaf, heard = sorted(w.runtimes.values(), key=lambda r: r.info.name)
        await deaf.endpoint._model_subs[1].unsubscribe()  # this pod misses the switch announcement

        async def traffic(sessions: list[str], turns: int) -> int:
            sent = 0
            for _ in range(turns):
                for sid in sessions:
                    await bus.publish(turn(sid, 8, 4))
                    sent += 1
                await asyncio.sleep(0.05)
            return sent

        before = w.stats.requests
        live = asyncio.create_task(traffic(old, 6))  # the old sessions keep talking through the rollout
        rollout = await begin_rollout(store, "llm", "llama", "2", from_version="1", prepare_timeout_s=60, by="test")
        with pytest.raises(RolloutRefused, match="in progress"):
            await begin_rollout(store, "llm", "llama", "3", by="test")
        await eventually(lambda: phase(store, rollout.rollout_id), timeout=30)
        await eventually(lambda: _is(phase(store, rollout.rollout_id), "switched"), timeout=30)
        await eventually(lambda: heard.agent.layout.model_version == "2", timeout=10)
        await eventually(lambda: deaf.agent.layout.model_version == "2", timeout=10)  # asked again, and switched
        sent = await live
        digests = {r.agent.layouts[v].weights_digest for r in w.runtimes.values() for v in r.agent.layouts}
        assert len(digests) == 2  # one set of weights per version

        new = [f"new-{i}" for i in range(6)]
        sent += await traffic(new + old, 3)
        await eventually(lambda: w.stats.requests >= before + sent and w.tracked()["locks"] == 0, timeout=60)

        # a pod is evicted: its sessions come back from their preStop checkpoints, each on its own version
        gone = max(w.runtimes.values(), key=lambda r: len(r.agent.sessions_on("1")))
        assert gone.agent.sessions_on("1") and await m.cluster.evict("llm", gone.info.name) is EvictionOutcome.EVICTED
        await eventually(lambda: gone.info.name not in w.runtimes and len(w.runtimes) == 2, timeout=30)
        before = w.stats.requests
        sent = await traffic(new + old, 2)
        await eventually(lambda: w.stats.requests >= before + sent and w.tracked()["locks"] == 0, timeout=60)
        replacement = next(r for r in w.runtimes.values() if r.info.name != heard.info.name)
        assert replacement.agent.layout.model_version == "2"

        served: dict[str, set[str]] = defaultdict(set)
        for sid, version in w.served_log:
            served[sid].add(version)
        assert all(served[s] == {"1"} for s in old), {s: served[s] for s in old}
        assert all(served[s] == {"2"} for s in new), {s: served[s] for s in new}
        assert w.stats.mixed_versions == 0 and w.stats.restored > 0
        assert w.stats.restore_verified == w.stats.restored and w.stats.restore_check_failed == 0
        assert w.stats.lost == 0 and w.stats.restore_refused_version == 0
        assert not (set(replacement.agent.sessions()) & set(old))  # it never held version 1
        # every checkpoint a session has is of one version: the one it began on
        for sid in old + new:
            layouts = {(await m.workload.store.manifest(sid, c)).layout for c in await w.store.checkpoints(sid)}
            assert {lay.model_version for lay in layouts} <= ({"1"} if sid in old else {"2"}), sid
        # and one of version 1 is refused by a pod that holds only version 2, naming the difference
        saved = [s for s in old if await w.store.checkpoints(s)]
        assert saved
        v2 = engine_for(spec.deployments[0], "2").layout
        fresh = KvAgent(w.store, pod="p", node="n", namespace="llm", deployment="llama", layout=v2)
        sid = saved[0]
        with pytest.raises(IncompatibleCheckpoint, match="model_version"):
            await fresh.restore(sid)

        # once the old sessions close, the pods let version 1 go
        for sid in old:
            await bus.publish(turn(sid, 0, 0))
        await eventually(lambda: all(list(r.agent.layouts) == ["2"] for r in w.runtimes.values()), timeout=30)


async def _is(value: object, expected: str) -> bool:
    return await value == expected  # type: ignore[misc]


async def test_a_failed_prepare_aborts_before_the_switch_and_everything_stays_on_the_old_version(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    spec = spec_of(2, kv_blocks=32, model=SMALL_MODEL)
    async with mesh(settings, subjects, bus, tmp_path, spec) as m:
        w = m.workload
        w.served_log = []
        store = ConfigStore(m.service.registry.client, subjects)
        broken = sorted(w.runtimes)[1]
        w.prepare_faults[broken] = "weights unreadable: shared storage answered EIO"
        talks = Conversations(spec, sessions=4, prompt_tokens=16, new_tokens=4, max_turns=5, seed=1, tag="ab")
        rollout = await begin_rollout(store, "llm", "llama", "2", from_version="1", by="test")
        sent = await send_rounds(bus, talks, 8)
        await eventually(lambda: _is(phase(store, rollout.rollout_id), "aborted"), timeout=30)
        _, doc = await read_models(store)
        entry = doc.deployments["llm/llama"]
        assert entry.serving_version == "1" and entry.rollout is not None
        assert f"{broken}: RuntimeError: weights unreadable" in entry.rollout.reason
        assert entry.rollout.failed == [f"{broken}: RuntimeError: weights unreadable: shared storage answered EIO"]
        sent += await send_rounds(bus, talks, 4)
        await eventually(lambda: w.stats.requests >= sent and w.tracked()["locks"] == 0, timeout=30)
        assert {v for _, v in w.served_log} == {"1"}
        assert all(r.agent.layout.model_version == "1" for r in w.runtimes.values())
        # the pod that did prepare lets the unused version go
        await eventually(lambda: all(list(r.agent.layouts) == ["1"] for r in w.runtimes.values()), timeout=10)
        # and a later rollout, the fault gone, goes through
        w.prepare_faults.clear()
        again = await begin_rollout(store, "llm", "llama", "2", by="test")
        await eventually(lambda: _is(phase(store, again.rollout_id), "switched"), timeout=30)
        await eventually(lambda: all(r.agent.layout.model_version == "2" for r in w.runtimes.values()), timeout=10)


async def test_the_cli_begins_a_rollout_waits_for_the_switch_and_refuses_a_second_one(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    env = dict(
        os.environ,
        GPUWARDEN_HOME=str(tmp_path / "home"),
        GPUWARDEN_NATS_URL=settings.nats.servers[0],
        GPUWARDEN_REDIS_URL=settings.redis.url,
        GPUWARDEN_ROOT=subjects.root,
    )

    async def cli(*argv: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shared.cli", "rollout", *argv, env=env, stdout=-1, stderr=-1
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode(), err.decode()

    async with mesh(settings, subjects, bus, tmp_path, spec_of(2, kv_blocks=32, model=SMALL_MODEL)) as m:
        code, out, err = await cli("llm/llama", "2")
        assert code == 2 and out == "" and err.count("\n") == 1 and "--from" in err
        code, out, err = await cli("nonsense", "2")
        assert code == 2 and "not namespace/name" in err
        code, out, _ = await cli("llm/llama", "2", "--from", "1", "--wait")
        assert code == 0, out
        assert json.loads(out.splitlines()[-1])["phase"] == "switched"
        await eventually(lambda: all(r.agent.layout.model_version == "2" for r in m.workload.runtimes.values()))
        code, _, err = await cli("llm/llama", "2")
        assert code == 2 and "already serves '2'" in err
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shared.cli", "status", "--json", env=env, stdout=-1, stderr=-1
        )
        out_b, err_b = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err_b.decode()
        (deployment,) = json.loads(out_b)["deployments"]
        assert deployment["serving_version"] == "2"
        assert deployment["rollout"]["phase"] == "switched" and deployment["rollout"]["to_version"] == "2"
        assert deployment["rollout"]["from_version"] == "1" and deployment["rollout"]["failed"] == []


async def test_with_pinned_sessions_end_the_old_sessions_end_with_the_reason_and_new_ones_run_on_the_new_version(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    spec = spec_of(2, kv_blocks=32, model=SMALL_MODEL)
    async with mesh(settings, subjects, bus, tmp_path, spec) as m:
        w = m.workload
        w.served_log = []
        store = ConfigStore(m.service.registry.client, subjects)
        old = await begin_sessions(bus, w, 4, prompt=16)
        rollout = await begin_rollout(
            store, "llm", "llama", "2", from_version="1", pinned_sessions="end", end_reason="moved to v2", by="test"
        )
        await eventually(lambda: _is(phase(store, rollout.rollout_id), "switched"), timeout=30)
        await eventually(lambda: w.stats.ended_by_rollout == len(old), timeout=30)
        assert all(w.retired.get(sid) == "moved to v2" for sid in old)
        await eventually(lambda: all(list(r.agent.layouts) == ["2"] for r in w.runtimes.values()), timeout=30)
        served = w.stats.served
        for sid in [*old, "new-1"]:
            await bus.publish(turn(sid, 8, 2))
        await eventually(lambda: w.stats.served == served + 1 and w.stats.refused_retired == len(old), timeout=30)
        assert [v for s, v in w.served_log if s == "new-1"] == ["2"]
        assert {v for s, v in w.served_log if s in old} == {"1"}  # never served on the new version
        assert w.stats.mixed_versions == 0
