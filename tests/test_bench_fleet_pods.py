"""The fleet benchmark's pod host (``bench.scale_upgrade.FleetPods``): a pod's preStop waits for the restores into
it that had begun, never for the rest of a move queued behind others; those sessions go on to another pod.

At 1,000 nodes, 100 at once, a preStop that waited for a whole move into its pod (one lock a pod) ran past the
driver policy's ``pod_deletion_timeout_s`` and stopped the upgrade. The pods here are small stand-ins for the
hosted pods (the agent's sessions and the endpoint's restore, final save and announcement): what is tested is the
host's ordering, not the mesh.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from bench.fleetkit import HostedPod
from bench.scale_upgrade import DEPLOYMENT, NAMESPACE, FleetPods
from shared.ports.cluster import PodInfo, PodPhase

BLOCK = b"\x07" * 16


class _Agent:
    def __init__(self) -> None:
        self.held: dict[str, list[bytes]] = {}

    def sessions(self) -> list[str]:
        return list(self.held)

    def blocks(self, sid: str) -> list[bytes]:
        return self.held.get(sid, [])


class _Endpoint:
    def __init__(self, agent: _Agent, store: dict[str, int], log: list[tuple[str, int]], name: str) -> None:
        self.agent, self.store, self.log, self.name = agent, store, log, name
        self.begun = asyncio.Event()
        self.saved = asyncio.Event()

    async def restore(self, sid: str, timeout: float) -> None:
        self.begun.set()
        await asyncio.sleep(0.02)
        self.agent.held[sid] = [BLOCK] * self.store[sid]

    async def final_save(self, deadline_s: float) -> None:
        self.log.append((self.name, len(self.agent.held)))
        self.saved.set()
        for sid, blocks in self.agent.held.items():
            self.store[sid] = len(blocks)

    async def announce(self) -> None:
        return None


class _Bench:
    block = memoryview(BLOCK)

    async def leave(self, pod: HostedPod) -> None:
        return None


class _Cluster:
    async def mark_prestop_done(self, namespace: str, name: str) -> None:
        return None


def _pod(name: str, sessions: dict[str, int], store: dict[str, int], log: list[tuple[str, int]]) -> _Endpoint:
    agent = _Agent()
    agent.held = {sid: [BLOCK] * n for sid, n in sessions.items()}
    store.update(sessions)
    return _Endpoint(agent, store, log, name)


def _hosted(pod: _Endpoint) -> HostedPod:
    return HostedPod(name=pod.name, node=f"node-{pod.name}", agent=cast(Any, pod.agent), endpoint=cast(Any, pod))


async def test_a_pre_stop_waits_only_for_the_restores_begun_and_the_rest_of_the_move_goes_on() -> None:
    store: dict[str, int] = {}
    log: list[tuple[str, int]] = []
    fleet = FleetPods(cast(Any, _Bench()), cast(Any, _Cluster()), replicas=3, grace_s=30.0)
    fleet._slots = asyncio.Semaphore(2)  # two restores at once, all moves together
    leaving = {f"a-{i}": 1 + i % 3 for i in range(20)}
    pods = {
        "a": _pod("a", leaving, store, log),
        "b": _pod("b", {}, store, log),
        "c": _pod("c", {f"c-{i}": 2 for i in range(5)}, store, log),
    }
    for name, pod in pods.items():
        fleet.pods[name] = _hosted(pod)
        fleet.busy[name] = 0
        fleet.incoming[name] = 0

    fleet.leaving.add("a")
    first = asyncio.create_task(fleet._pre_stop("a"))
    await asyncio.wait_for(pods["b"].begun.wait(), timeout=10)  # the move into the emptiest pod has begun
    fleet.leaving.add("b")  # and now that pod turns Terminating
    second = asyncio.create_task(fleet._pre_stop("b"))
    await asyncio.wait_for(asyncio.gather(first, second), timeout=10)
    await asyncio.wait_for(fleet.settled(10), timeout=15)

    b_saved = dict(log)["b"]
    assert 1 <= b_saved <= 4, f"b's final save held {b_saved} of a's 20 sessions: it waited for the queued move"
    held = pods["c"].agent.held
    assert sorted(held) == sorted([*leaving, *(f"c-{i}" for i in range(5))])
    assert all(len(held[sid]) == blocks for sid, blocks in leaving.items())
    assert fleet.problems == []
    assert fleet.prestops == 2 and fleet.moved == 20 + b_saved
    assert set(fleet.pods) == {"c"} and fleet.busy == {"c": 0} and fleet.incoming == {"c": 0}


class _SlowBench(_Bench):
    """Hosts a pod only once ``started`` is set: a pod's agent starting on a loaded machine."""

    def __init__(self, store: dict[str, int], log: list[tuple[str, int]]) -> None:
        self.started = asyncio.Event()
        self.store, self.log = store, log

    async def add_pod(self, name: str, node: str) -> HostedPod:
        await self.started.wait()
        return _hosted(_pod(name, {}, self.store, self.log))


class _Listing(_Cluster):
    def __init__(self, pods: list[PodInfo]) -> None:
        self.listed = pods

    async def pods(self, node: str | None = None, namespace: str | None = None) -> list[PodInfo]:
        return self.listed


def _info(name: str, phase: PodPhase) -> PodInfo:
    return PodInfo(name=name, namespace=NAMESPACE, node=f"node-{name}", deployment=DEPLOYMENT, phase=phase)


async def test_a_reading_of_the_cluster_starts_the_pre_stops_without_waiting_for_new_pods_to_start() -> None:
    store: dict[str, int] = {}
    log: list[tuple[str, int]] = []
    bench = _SlowBench(store, log)
    cluster = _Listing([_info("old", "Terminating"), _info("new", "Running")])
    fleet = FleetPods(cast(Any, bench), cast(Any, cluster), replicas=2, grace_s=30.0)
    old = _pod("old", {"s-1": 2}, store, log)
    fleet.pods["old"], fleet.busy["old"], fleet.incoming["old"] = _hosted(old), 0, 0

    await asyncio.wait_for(fleet.reconcile(), timeout=5)  # "new" cannot start yet: the reading does not wait
    assert "new" in fleet.joining and "new" not in fleet.pods
    await asyncio.wait_for(old.saved.wait(), timeout=5)  # "old"'s preStop saves meanwhile
    assert log == [("old", 1)]
    bench.started.set()  # "new" starts: "old"'s session moves there
    await asyncio.wait_for(fleet.settled(10), timeout=15)
    assert set(fleet.pods) == {"new"} and fleet.joining == {}
    assert fleet.pods["new"].agent.sessions() == ["s-1"] and fleet.moved == 1 and fleet.problems == []
