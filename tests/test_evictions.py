"""The one eviction routine (``shared.clients.evictions``): a round asks the Eviction API once per pod, says which
pods a PodDisruptionBudget refused, and the backoff after refused rounds doubles up to its cap and starts over."""

from __future__ import annotations

from shared.clients.evictions import COMMAND_BACKOFF, MAX_BACKOFF_S, PdbBackoff, evict_pods
from shared.contract.subjects import Subjects
from shared.plumbing.settings import Settings
from shared.sim.cluster import SimCluster
from shared.sim.spec import DeploymentSpec, NodeSpec, SimSpec


def test_the_backoff_doubles_from_its_first_delay_up_to_its_cap() -> None:
    delays: list[float] = []
    previous: float | None = None
    for _ in range(6):
        previous = COMMAND_BACKOFF.after(previous)
        delays.append(previous)
    assert delays == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    controller = PdbBackoff(first_s=2.0)
    assert controller.max_s == MAX_BACKOFF_S == 60.0
    assert [controller.after(None), controller.after(2.0), controller.after(40.0)] == [2.0, 4.0, 60.0]
    assert PdbBackoff(first_s=90.0).after(None) == 60.0  # never above the cap, not even the first delay


async def test_a_round_evicts_what_the_budget_allows_and_names_what_it_refused(
    settings: Settings, subjects: Subjects, redis_client: object
) -> None:
    spec = SimSpec(
        nodes=[NodeSpec(name="node-1")],
        deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2, max_unavailable=1)],
    )
    cluster = await SimCluster.create(settings.redis, subjects, spec)
    try:
        pods = [(p.namespace, p.name) for p in await cluster.pods(node="node-1")]
        assert len(pods) == 2
        heard: list[tuple[str, str]] = []
        done = await evict_pods(cluster, "node-1", pods, lambda namespace, name: heard.append((namespace, name)))
        assert done.evicted == [f"llm/{pods[0][1]}"] and heard == [pods[0]]
        assert done.refused == [f"llm/{pods[1][1]}"] and done.blocked
        again = await evict_pods(cluster, "node-1", [])
        assert not again.blocked and not again.evicted
    finally:
        await cluster.close()
