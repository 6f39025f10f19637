"""The simulated engines' KV capacity: a block pool per pod that never holds more than it has, sessions that
end (closed, full context, idle) and leave the agent and the registry, recompute preemption that brings a
session back with the right bytes, and workload structures that stay bounded however many sessions pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.contract.requests import InferenceRequest
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from shared.ports.cluster import EvictionOutcome
from shared.sim.blockpool import BlockPool, PoolTooSmall
from shared.sim.conversations import Conversations
from shared.sim.engines import verify_blocks
from shared.sim.sessions import FIRST_TOKEN_BUCKETS_S, FirstTokens, is_close, quantile
from shared.sim.spec import (
    TINY_LLAMA,
    DeploymentSpec,
    ModelShape,
    SpecError,
    default_spec,
    parse_spec,
)
from shared.sim.workload import SimWorkload
from tests.helpers import eventually
from tests.workloadkit import SMALL_MODEL, mesh, send_rounds, spec_of, turn


# -- the pool, as a pure rule ---------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=4, max_value=40),
    st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(0, 40)), max_size=80),
)
def test_the_pool_never_holds_more_than_its_capacity_and_preempts_the_newest_arrivals(
    capacity: int, steps: list[tuple[bool, int, int]]
) -> None:
    pool = BlockPool(capacity)
    for release, who, blocks in steps:
        sid = f"s{who}"
        if release:
            pool.release(sid)
        elif blocks > capacity:
            with pytest.raises(PoolTooSmall):
                pool.reserve(sid, blocks)
        else:
            before = pool.sessions()
            victims = pool.reserve(sid, blocks)
            assert sid not in victims and pool.held(sid) >= blocks
            others = [s for s in before if s != sid]
            assert victims == list(reversed(others))[: len(victims)]  # the most recent arrivals, newest first
            assert [s for s in pool.sessions() if s != sid] == others[: len(others) - len(victims)]
        assert pool.used == sum(pool.held(s) for s in pool.sessions()) <= capacity
        assert pool.peak <= capacity


def test_a_preempted_session_arrives_again_at_the_back() -> None:
    pool = BlockPool(10)
    assert pool.reserve("a", 4) == [] and pool.reserve("b", 4) == []
    assert pool.reserve("c", 4) == ["b"]
    assert pool.reserve("b", 4) == ["c"]  # "c" came after "a": the newest other session goes first
    assert pool.sessions() == ["a", "b"] and pool.used == 8 and pool.preemptions == 2


# -- the spec -------------------------------------------------------------------------------------------------------
def test_capacity_follows_the_gpu_memory_as_vllm_sizes_its_pool() -> None:
    llama = DeploymentSpec(name="llama")  # Llama-3-8B: 15,316 MiB of weights, 2 MiB blocks, 0.9 of the GPU
    assert llama.kv_capacity(81559) == int((81559 * 0.9 - 15316) / 2)  # H100 80GB: 29,043 blocks
    assert llama.kv_capacity(23034) == 2707  # L4
    assert DeploymentSpec(name="llama", gpus_per_pod=2).kv_capacity(23034) == int((2 * 23034 * 0.9 - 15316) / 2)
    assert DeploymentSpec(name="llama", kv_blocks=600).kv_capacity(81559) == 600
    assert default_spec().deployments[0].kv_capacity(81559) == 128


@pytest.mark.parametrize(
    ("deployment", "message"),
    [
        ("{name: a, kv_blocks: 10}", r"\$\.deployments\[0\]\.kv_blocks: .*holds 10 blocks.*8192 tokens"),
        ("{name: a, kv_blocks: 100000}", r"\$\.deployments\[0\]\.kv_blocks: .*do not fit in the 8243 MiB"),
        ("{name: a, gpu_memory_utilization: 0.5}", r"\$\.deployments\[0\]\.gpu_memory_utilization: .*weights"),
        ("{name: a, gpu_memory_utilization: 0.67}", r"gpu_memory_utilization: .*fewer than one model\.max_model_len"),
        ("{name: a, gpu_memory_utilization: 1.5}", r"\$\.deployments\[0\]\.gpu_memory_utilization"),
        ("{name: a, model: {max_model_len: 0}}", r"\$\.deployments\[0\]\.model\.max_model_len"),
        ("{name: a, kv_blocks: -1}", r"\$\.deployments\[0\]\.kv_blocks"),
    ],
)
def test_a_pool_that_cannot_serve_is_refused_naming_the_field(deployment: str, message: str) -> None:
    raw = f"nodes: [{{name: n1, gpus: [{{memory_mib: 23559}}]}}]\ndeployments: [{deployment}]"
    with pytest.raises(SpecError, match=message):
        parse_spec(raw, "spec.yaml")


def test_an_explicit_pool_that_fits_is_taken() -> None:
    spec = parse_spec("nodes: [{name: n1}]\ndeployments: [{name: a, kv_blocks: 512, model: {max_model_len: 8192}}]")
    assert spec.deployments[0].kv_capacity(81559) == 512


# -- the traffic ----------------------------------------------------------------------------------------------------
def test_conversations_have_bounded_turns_then_close_and_make_way_for_new_ones() -> None:
    spec = spec_of(1, 32)
    talks = Conversations(spec, sessions=5, prompt_tokens=30, new_tokens=10, max_turns=8, seed=3, tag="t")
    turns: dict[str, int] = {}
    closed: list[str] = []
    for _ in range(2000):
        for request in talks.next_requests():
            sid = request.session_id
            assert sid not in closed, "a request after the close"
            if is_close(request):
                closed.append(sid)
            else:
                turns[sid] = turns.get(sid, 0) + 1
        assert len(set(turns) - set(closed)) <= 5  # never more open at once than asked for
    assert len(closed) > 200 and talks.started == len(closed) + 5
    full = SMALL_MODEL.max_model_len // 40 + 1  # the turn that passes max_model_len is the last one
    assert all(1 <= turns[s] <= min(8, full) for s in closed)
    assert any(turns[s] == full for s in closed)
    assert len(talks.closing()) == 5


# -- on the bus -----------------------------------------------------------------------------------------------------
def close(sid: str) -> InferenceRequest:
    return InferenceRequest(namespace="llm", deployment="llama", session_id=sid)


def quiet(workload: SimWorkload) -> bool:
    """No session anywhere: every pod's agent and pool empty, nothing tracked per session."""
    tracked = workload.tracked()
    return (
        all(not r.agent.sessions() and r.pool.used == 0 and not len(r.pool) for r in workload.runtimes.values())
        and tracked["home"] == tracked["preempted"] == tracked["last_request"] == tracked["served_on"] == 0
        and tracked["locks"] == 0
    )


async def test_heavy_traffic_fills_the_pools_but_never_past_their_capacity(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    spec = spec_of(2, kv_blocks=24)  # 24 blocks of 16 tokens per pod; a session ends past 256 tokens
    async with mesh(settings, subjects, bus, tmp_path, spec) as m:
        talks = Conversations(spec, sessions=12, prompt_tokens=32, new_tokens=16, max_turns=7, seed=11, tag="hv")
        sent = await send_rounds(bus, talks, 160)
        for request in talks.closing():
            await bus.publish(request)
            sent += 1
        w = m.workload
        await eventually(lambda: w.stats.requests >= sent and quiet(w), timeout=60)
        assert w.checks >= sent and w.violations == []
        assert all(r.pool.preemptions > 0 and r.pool.peak <= 24 for r in w.runtimes.values())  # full, never over
        stats = w.stats
        assert stats.preemptions > 0 and stats.recomputed > 0
        assert stats.ended > 20 and stats.ended_at_max_len > 0
        assert stats.lost == 0 and stats.restored == 0


async def test_sessions_end_and_leave_the_agent_and_the_registry(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    async with mesh(settings, subjects, bus, tmp_path, spec_of(1, kv_blocks=32)) as m:
        w, registry = m.workload, m.service.registry
        (runtime,) = w.runtimes.values()
        for sid in ("keep", "done", "long"):
            await bus.publish(turn(sid, 100, 20))
        await eventually(lambda: w.stats.served == 3)

        async def registered(expected: set[str]) -> bool:
            return {s.session_id for s in await registry.sessions_on_node(runtime.info.node)} == expected

        await eventually(lambda: registered({"keep", "done", "long"}))
        await bus.publish(close("done"))
        await bus.publish(turn("long", 100, 40))  # 260 tokens: past max_model_len, the session ends
        await eventually(lambda: w.stats.ended == 1 and w.stats.ended_at_max_len == 1)
        assert runtime.agent.sessions() == ["keep"] and runtime.pool.sessions() == ["keep"]
        assert runtime.pool.used == 8 and set(w.home) == {"keep"} == set(w.last_request)
        await eventually(lambda: registered({"keep"}))
        await bus.publish(close("done"))  # a redelivered close finds nothing to close
        await eventually(lambda: w.stats.requests == 6)
        assert w.stats.ended == 1 and w.stats.started_fresh == 3


async def test_a_preempted_session_is_recomputed_with_the_right_bytes_on_its_next_request(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    model = ModelShape(layers=2, kv_heads=2, head_dim=64, block_tokens=16, max_model_len=128)
    async with mesh(settings, subjects, bus, tmp_path, spec_of(1, kv_blocks=8, model=model)) as m:
        w = m.workload
        (runtime,) = w.runtimes.values()
        await bus.publish(turn("first", 70, 10))  # 5 blocks
        await eventually(lambda: w.stats.served == 1)
        await bus.publish(turn("second", 70, 10))  # 5 more: the pool has 8, so "first" is preempted
        await eventually(lambda: w.stats.served == 2)
        assert w.stats.preemptions == 1 and runtime.agent.sessions() == ["second"]
        assert w.preempted["first"].tokens == 80 and runtime.pool.used == 5 and "first" not in runtime.pool

        await bus.publish(turn("first", 10, 6))  # recomputed to 80 tokens, then grown to 96: "second" goes
        await eventually(lambda: w.stats.served == 3)
        assert w.stats.recomputed == 1 and w.stats.preemptions == 2 and w.stats.restored == 0
        assert runtime.agent.sessions() == ["first"] and runtime.agent.tokens("first") == 96
        blocks = w.session_blocks("first") or []
        assert len(blocks) == 6 and verify_blocks("first", blocks)
        assert w.preempted["second"].tokens == 80 and "first" not in w.preempted

        await bus.publish(turn("second", 0, 16))
        await eventually(lambda: w.stats.served == 4)
        assert runtime.agent.tokens("second") == 96 and verify_blocks("second", w.session_blocks("second") or [])
        assert w.stats.recomputed == 2 and w.stats.lost == 0 and runtime.pool.peak <= 8


async def test_a_real_model_under_pressure_recomputes_and_restores_to_the_reference_bits(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    """The tiny Llama on two pods with small pools: sessions are preempted and recomputed, a pod is evicted (its
    sessions restored elsewhere from their preStop checkpoints); every live session still equals a reference run
    of its conversation, and every restore was checked."""
    model = msgspec.structs.replace(TINY_LLAMA, max_model_len=256)
    spec = spec_of(2, kv_blocks=16, model=model)  # one longest session per pod
    async with mesh(settings, subjects, bus, tmp_path, spec) as m:
        w = m.workload
        talks = Conversations(spec, sessions=8, prompt_tokens=24, new_tokens=8, max_turns=6, seed=2, tag="real")
        sent = await send_rounds(bus, talks, 48)
        await eventually(lambda: w.stats.requests >= sent and w.tracked()["locks"] == 0, timeout=60)
        assert w.stats.preemptions > 0 and w.stats.recomputed > 0 and w.violations == []
        gone = min(w.runtimes.values(), key=lambda r: len(r.agent.sessions()) * -1)
        moving = gone.agent.sessions()
        assert moving
        assert await m.cluster.evict("llm", gone.info.name) is EvictionOutcome.EVICTED
        await eventually(lambda: gone.info.name not in w.runtimes and len(w.runtimes) == 2, timeout=30)
        sent += await send_rounds(bus, talks, 12)
        await eventually(lambda: w.stats.requests >= sent and w.tracked()["locks"] == 0, timeout=60)
        assert w.stats.restored > 0 and w.stats.lost == 0
        assert w.stats.restore_verified == w.stats.restored and w.stats.restore_check_failed == 0
        live = [s for r in w.runtimes.values() for s in r.agent.sessions()]
        assert live
        for sid in live:
            check = await w.check_session(sid)
            assert check.verified is True, (sid, check.detail)


async def test_idle_sessions_end(settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path) -> None:
    now = [1000.0]
    async with mesh(
        settings, subjects, bus, tmp_path, spec_of(1, kv_blocks=16), session_idle_s=60.0, clock=lambda: now[0]
    ) as m:
        w = m.workload
        (runtime,) = w.runtimes.values()
        await bus.publish(turn("quiet", 50))
        await bus.publish(turn("busy", 50))
        await eventually(lambda: w.stats.served == 2)
        now[0] += 45
        await bus.publish(turn("busy", 10))
        await eventually(lambda: w.stats.served == 3)
        now[0] += 20  # "quiet" idle for 65 s, "busy" for 20 s
        await eventually(lambda: w.stats.expired == 1)
        assert runtime.agent.sessions() == ["busy"] and set(w.last_request) == {"busy"} == set(w.home)


async def test_a_session_that_ends_while_no_pod_holds_it_leaves_the_registry_as_ended(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    """Its pod drained away (evicted after its preStop save) and its client closing it before any pod brought it
    back: a pod takes it and ends it, so the registry retires its checkpoints and says it ended (what ``gpuwarden
    drain --wait`` waits for; without it the wait never ends)."""
    async with mesh(settings, subjects, bus, tmp_path, spec_of(2, kv_blocks=16)) as m:
        w = m.workload
        await bus.publish(turn("closed-away", 40, 8))
        await eventually(lambda: w.stats.served == 1)
        gone = w.runtimes[w.home["closed-away"]]
        await eventually(lambda: _located(m.service, "closed-away", gone.info.name), timeout=10)
        assert await m.cluster.evict("llm", gone.info.name) is EvictionOutcome.EVICTED
        await eventually(lambda: gone.info.name not in w.runtimes, timeout=20)
        assert await m.service.registry.newest_checkpoint("closed-away") is not None  # its preStop save
        await bus.publish(turn("closed-away", 0, 0))  # the client closes it; no pod holds it

        async def ended() -> bool:
            return (await m.service.registry.where("closed-away")).reason == "ended"

        await eventually(ended, timeout=20)
        await eventually(lambda: quiet(w), timeout=20)
        assert w.stats.lost == 0 and "closed-away" not in w.versions and w.tracked()["home"] == 0


async def _located(service: Any, sid: str, pod: str) -> bool:
    return (await service.registry.where(sid)).pod == pod


async def test_structures_stay_bounded_after_many_sessions_and_a_pod_deletion(
    settings: Settings, subjects: Subjects, bus: Bus, tmp_path: Path
) -> None:
    spec = spec_of(2, kv_blocks=16)
    async with mesh(settings, subjects, bus, tmp_path, spec) as m:
        w = m.workload
        talks = Conversations(spec, sessions=4, prompt_tokens=20, new_tokens=12, max_turns=3, seed=5, tag="many")
        sent = await send_rounds(bus, talks, 600)
        await eventually(lambda: w.stats.requests >= sent, timeout=60)
        old = min(w.runtimes.values(), key=lambda r: r.info.name)
        assert old.agent.sessions()  # the pod holds sessions when it goes
        assert await m.cluster.evict("llm", old.info.name) is EvictionOutcome.EVICTED
        await eventually(lambda: old.info.name not in w.runtimes and len(w.runtimes) == 2, timeout=20)
        assert old.agent.sessions() == []  # the deleted pod's agent holds no blocks any more
        assert old.info.name not in w.home.values()
        for request in talks.closing():
            await bus.publish(request)
            sent += 1
        await eventually(lambda: w.stats.requests >= sent and quiet(w), timeout=30)
        assert talks.started > 150 and w.stats.ended > 100
        assert w.tracked() == {
            "runtimes": 2,
            "home": 0,
            "versions": 0,
            "preempted": 0,
            "killed": 0,
            "last_request": 0,
            "served_on": 0,
            "locks": 0,
            "tasks": 2,  # the cluster watch and the reconcile loop; finished preStop tasks are gone
            "lost_sessions": 0,
            "conversations": 0,
        }
        assert w.stats.lost == 0 and w.stats.prestop_saves == 1


def test_the_synthetic_spec_compose_runs_is_the_default_world_without_torch() -> None:
    shipped = Path(__file__).resolve().parents[1] / "deploy" / "sim" / "synthetic.yaml"
    spec = parse_spec(shipped.read_bytes(), str(shipped))
    default = default_spec()
    assert [n.name for n in spec.nodes] == [n.name for n in default.nodes]
    assert spec.nodes[2].gpus == default.nodes[2].gpus
    (deployment,) = spec.deployments
    assert deployment.model.engine == "synthetic" and deployment.model.block_bytes == 2 * 2**20
    assert (deployment.kv_blocks, deployment.model.max_model_len) == (128, 1024)


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "deploy" / "sim").glob("*.yaml"))
)
def test_every_shipped_spec_parses_and_its_pools_can_serve(name: str) -> None:
    shipped = Path(__file__).resolve().parents[1] / "deploy" / "sim" / name
    spec = parse_spec(shipped.read_bytes(), str(shipped))  # capacity checked against every node's GPUs
    assert spec.deployments and spec.nodes


def test_first_tokens_are_counted_apart_for_moved_sessions_and_their_median_read_from_the_buckets() -> None:
    """The buckets of ``FirstTokens`` and their quantile as ``histogram_quantile`` reads them: linear within the
    bucket, the open last bucket its lower bound, nothing counted no figure (never 0)."""
    waited = FirstTokens()
    for seconds in (0.003, 0.004, 0.015, 0.015):
        waited.add(False, seconds)
    waited.add(True, 0.3)
    waited.add(True, 90.0)
    status = waited.as_status()
    assert status["buckets_s"] == list(FIRST_TOKEN_BUCKETS_S)
    assert sum(status["stayed"]) == 4 and sum(status["moved"]) == 2
    assert status["stayed"][0] == 2 and status["stayed"][2] == 2  # <= 5 ms twice, in (10, 20] ms twice
    assert quantile(status["stayed"], 0.5) == pytest.approx(0.005)  # the second of four: the first bucket's top
    assert quantile(status["stayed"], 0.75) == pytest.approx(0.015)  # half-way into (10, 20] ms
    assert quantile(status["moved"], 0.5) == pytest.approx(0.5)  # rank 1 of 2: all of the (0.2, 0.5] bucket
    assert quantile(status["moved"], 0.25) == pytest.approx(0.35)  # rank 0.5: half-way into it
    assert quantile(status["moved"], 1.0) == FIRST_TOKEN_BUCKETS_S[-1]
    assert quantile([0] * len(status["moved"]), 0.5) is None


def test_a_real_model_without_torch_is_one_clear_error() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # as in an image without torch
        "from shared.sim.engines import engine_for\n"
        "from shared.sim.spec import default_spec\n"
        "engine_for(default_spec().deployments[0])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("shared.sim.spec.SpecError: deployment llm/llama: model.engine transformers needs torch")
    assert "model.engine: synthetic (deploy/sim/synthetic.yaml)" in last
