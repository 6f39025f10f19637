"""``gpuwarden status`` reads a fleet in a few batched reads (``shared.plumbing.newest``): every node's newest
inventory and drain and every deployment's newest scale decision, read from the events stream of a real NATS, the
cluster from the simulated one in a real Redis."""

from __future__ import annotations

import redis.asyncio as aioredis
from aiohttp import web
from rich.console import Console

from shared.clients.drains import newest_drain, newest_drains
from shared.console.client import CommandError, MeshClient
from shared.console.render import status_tables
from shared.console.snapshot import take
from shared.contract.device import DeviceInventory, GpuDevice
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.scaler import ScaleDecision
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.newest import BATCH_SUBJECTS, newest_messages
from shared.plumbing.settings import Settings
from shared.sim.cluster import SimCluster
from shared.sim.spec import default_spec


async def ask(bus: Bus, drain_id: str, node: str) -> None:
    """A drain request as the CLI publishes it."""
    await bus.publish(
        DrainRequested(node=node, drain_id=drain_id, reason="maintenance", requested_by="cli", deadline_s=20.0)
    )


async def test_the_newest_message_of_many_subjects_is_read_in_batches_or_one_by_one(
    bus: Bus, subjects: Subjects
) -> None:
    await bus.ensure_streams()
    nodes = [f"node-{i}" for i in range(BATCH_SUBJECTS + 50)]  # more than one batch
    await bus.publish_many([DeviceInventory(node=n, driver_version="1") for n in nodes])
    await bus.publish_many([DeviceInventory(node=n, driver_version="2") for n in nodes[::2]])
    wanted = [subjects.pattern("device.inventory", node=n) for n in [*nodes, "node-never"]]
    stream = subjects.events_stream.name
    batched = await newest_messages(bus.nc, bus.js, stream, wanted)
    each = await newest_messages(bus.nc, bus.js, stream, wanted, batched=False)
    assert batched == each and len(batched) == len(nodes)  # the one with no message is left out
    first, second = (batched[subjects.pattern("device.inventory", node=n)] for n in nodes[:2])
    assert b'"driver_version":"2"' in first.data and b'"driver_version":"1"' in second.data
    assert first.seq > second.seq and first.subject == subjects.pattern("device.inventory", node="node-0")
    assert await newest_messages(bus.nc, bus.js, stream, []) == {}


async def test_the_newest_drains_of_many_nodes_are_what_each_node_read_alone_gives(bus: Bus) -> None:
    await bus.ensure_streams()
    await ask(bus, "done", "node-1")
    await bus.publish(DrainCompleted(node="node-1", drain_id="done", sessions_committed=3))
    await ask(bus, "running", "node-2")
    await ask(bus, "old", "node-3")
    await bus.publish(DrainFailed(node="node-3", drain_id="old", reason="deadline passed"))
    await ask(bus, "new", "node-3")
    await bus.publish(DrainFailed(node="node-3", drain_id="old", reason="deadline passed"))  # answered again
    await bus.publish(DrainCompleted(node="node-3", drain_id="new", sessions_committed=1))
    await ask(bus, "again", "node-4")
    await bus.publish(DrainFailed(node="node-4", drain_id="again", reason="deadline passed"))
    await bus.publish(DrainCompleted(node="node-4", drain_id="before", sessions_committed=1))  # another drain's

    nodes = ["node-1", "node-2", "node-3", "node-4", "node-5"]
    found = await newest_drains(bus, nodes)
    assert set(found) == {"node-1", "node-2", "node-3", "node-4"}
    for node in nodes[:4]:
        assert found[node] == await newest_drain(bus, node), node
    assert found["node-2"].verdict is None and found["node-1"].verdict is not None
    assert isinstance(found["node-3"].verdict, DrainCompleted) and found["node-3"].verdict.drain_id == "new"
    assert isinstance(found["node-4"].verdict, DrainFailed) and found["node-4"].verdict.drain_id == "again"


async def test_status_shows_each_node_inventory_drain_and_deployment_decision(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis
) -> None:
    await bus.ensure_streams()
    cluster = await SimCluster.create(redis_client, subjects, default_spec())
    gpus = [GpuDevice(index=0, uuid="GPU-a", model="H100", memory_total_mib=81559)]
    await bus.publish(DeviceInventory(node="node-1", driver_version="550.90.07", gpus=gpus))
    await bus.publish(DeviceInventory(node="node-2", driver_version="550.54.15"))
    await bus.publish(DeviceInventory(node="node-2", driver_version="560.35.03"))
    await bus.publish(ScaleDecision(namespace="llm", deployment="llama", desired_replicas=3, reason="queue 40"))
    await ask(bus, "d-1", "node-1")
    await bus.publish(DrainCompleted(node="node-1", drain_id="d-1", sessions_committed=2))
    await cluster.cordon("node-1")
    await ask(bus, "d-2", "node-2")
    await ask(bus, "d-3", "node-3")
    await bus.publish(DrainCompleted(node="node-3", drain_id="d-3"))  # decided, node schedulable: not in flight

    status = await take(MeshClient(settings, bus, redis_client, cluster))
    nodes = {n.name: n for n in status.nodes}
    assert nodes["node-1"].driver_version == "550.90.07" and [g.uuid for g in nodes["node-1"].gpus] == ["GPU-a"]
    assert nodes["node-2"].driver_version == "560.35.03" and not nodes["node-1"].schedulable
    assert [(d.namespace, d.name, d.scaler_desired, d.why) for d in status.deployments] == [
        ("llm", "llama", 3, "queue 40")
    ]
    drains = {d.node: d for d in status.drains}
    assert set(drains) == {"node-1", "node-2"}
    assert drains["node-1"].state == "completed" and drains["node-1"].cordoned
    assert drains["node-1"].sessions_committed == 2
    assert drains["node-2"].state == "running" and drains["node-2"].id == "d-2" and not drains["node-2"].cordoned
    assert status.sessions_total is None and "checkpoint service" in status.sessions_error  # none runs here


async def test_status_shows_per_deployment_where_the_router_sent_its_requests(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis
) -> None:
    """From the router's own health (``landed`` per pool), as ``gpuwarden up`` lists it in the run's state."""
    await bus.ensure_streams()
    cluster = await SimCluster.create(redis_client, subjects, default_spec())
    counts = {"holder": 40, "prefetched": 6, "cold": 1, "new": 3, "unavailable": 0}

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"service": "router", "landed": {"llm/llama": counts}})

    app = web.Application()
    app.router.add_get("/healthz", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        mesh = MeshClient(settings, bus, redis_client, cluster, services={"router": f"http://127.0.0.1:{port}/healthz"})
        status = await take(mesh)
    finally:
        await runner.cleanup()
    (llama,) = [d for d in status.deployments if d.name == "llama"]
    assert llama.landed == counts
    assert all(d.landed is None for d in status.deployments if d.name != "llama")
    shown = Console(width=300, record=True)
    shown.print(status_tables(status))
    assert "holder 40, prefetched 6, cold 1, new 3" in shown.export_text()


async def test_status_filters_name_what_the_cluster_has_when_it_lacks_what_was_asked(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis
) -> None:
    await bus.ensure_streams()
    cluster = await SimCluster.create(redis_client, subjects, default_spec())
    mesh = MeshClient(settings, bus, redis_client, cluster)
    for (node, pod, deployment), words in (
        (("node-9", "", ""), ("--node node-9", "node-1")),
        (("", "llama-nope", ""), ("--pod llama-nope",)),
        (("", "", "llm/nope"), ("--deployment llm/nope", "llm/llama")),
    ):
        try:
            await take(mesh, node=node, pod=pod, deployment=deployment)
        except CommandError as exc:
            assert all(word in str(exc) for word in words), str(exc)
        else:
            raise AssertionError(f"{node or pod or deployment}: taken")


def test_status_deployment_is_namespace_slash_name() -> None:
    from shared.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["status", "--deployment", "llm/llama"]).deployment == "llm/llama"
    for bad in ("llama", "llm/", "/llama", "llm/Bad_Name"):
        try:
            parser.parse_args(["status", "--deployment", bad])
        except SystemExit as exc:
            assert exc.code == 2, bad
        else:
            raise AssertionError(f"--deployment {bad} accepted")


def test_a_large_fleet_table_lists_the_nodes_that_need_attention_first_and_counts_the_rest() -> None:
    import io

    from rich.console import Console

    from shared.console.render import status_tables
    from shared.console.snapshot import GpuView, MeshStatus, NodeView

    def gpu(healthy: bool = True) -> GpuView:
        return GpuView(index=0, uuid="GPU-x", model="H100", healthy=healthy, memory_total_mib=81559)

    def fleet(count: int) -> MeshStatus:
        nodes = [
            NodeView(
                name=f"node-{i:03}", schedulable=True, ready=True, driver_version="1", upgrade_state="", gpus=[gpu()]
            )
            for i in range(count)
        ]
        nodes[-1].schedulable = False
        nodes[-2].gpus = [gpu(healthy=False)]
        return MeshStatus(taken_at=0.0, root="t", simulated=True, nodes=nodes, deployments=[], sessions=[], drains=[])

    def shown(status: MeshStatus) -> str:
        out = io.StringIO()
        Console(file=out, width=200).print(status_tables(status, max_nodes=10))
        return out.getvalue()

    small = shown(fleet(10))
    assert all(f"node-{i:03}" in small for i in range(10)) and "more nodes" not in small
    large = shown(fleet(50))
    assert "nodes (SIMULATED): 50, 50 GPUs (1 unhealthy), 1 cordoned" in large
    assert large.index("node-048") < large.index("node-049") < large.index("node-000")  # attention first
    listed = [i for i in range(50) if f"node-{i:03} " in large]
    assert listed == [*range(8), 48, 49], listed
    assert "... and 40 more nodes (2 need attention" in large and "0 of them not listed" in large


def test_the_sessions_table_says_how_each_session_got_where_it_is_and_no_size_before_a_checkpoint() -> None:
    """``restored+verified``: ``yes`` (restored on the pod that holds it, under the generation it holds, every
    digest checked), ``gen N`` (its last verified restore was under an earlier generation, elsewhere), ``-`` (never
    restored); a session with no checkpoint yet shows no bytes or tokens, only ``none yet``."""
    import io

    from rich.console import Console

    from shared.console.render import status_tables
    from shared.console.snapshot import CheckpointView, MeshStatus, SessionView

    saved = CheckpointView(id="c1", at=0.0, bytes=49152, tokens=95)
    sessions = [
        SessionView(id="s-restored", pod="p1", node="n1", generation=2, bytes=49152, tokens=95, last_checkpoint=saved),
        SessionView(id="s-moved-on", pod="p1", node="n1", generation=3, restored_generation=2),
        SessionView(id="s-fresh", pod="p1", node="n1", generation=1, bytes=49152, tokens=95, last_checkpoint=saved),
    ]
    sessions[0].verified_after_restore = True
    status = MeshStatus(taken_at=5.0, root="t", simulated=True, nodes=[], deployments=[], sessions=sessions, drains=[])
    out = io.StringIO()
    Console(file=out, width=200).print(status_tables(status))
    rows = {line.split()[1]: line.split("│")[1:-1] for line in out.getvalue().splitlines() if "│ s-" in line}
    cells = {sid: [cell.strip() for cell in row] for sid, row in rows.items()}
    assert cells["s-restored"][3:] == ["2", "48.0 KiB", "95", "5s ago", "yes"], cells
    assert cells["s-moved-on"][3:] == ["3", "-", "-", "none yet", "gen 2"], cells
    assert cells["s-fresh"][3:] == ["1", "48.0 KiB", "95", "5s ago", "-"], cells


async def test_status_reads_how_each_session_got_to_its_pod_from_its_newest_restore(
    settings: Settings, subjects: Subjects, bus: Bus, redis_client: aioredis.Redis
) -> None:
    """``restored+verified`` from the events stream: a restore by the pod and generation that hold the session is
    ``yes``; a restore under an earlier generation (it moved on since, without one) is that generation; no restore
    is neither. The page of sessions comes from a responder standing in for the checkpoint service."""
    from shared.console.snapshot import read_sessions
    from shared.contract.checkpoint import SessionRestored
    from shared.contract.sessions import SessionRecord, SessionsPage, SessionsQuery

    await bus.ensure_streams()
    records = [
        SessionRecord(session_id="s-here", pod="p-2", node="n-2", generation=2, checkpoint_id="c-1", checkpoint_at=1.0),
        SessionRecord(session_id="s-moved", pod="p-3", node="n-3", generation=3),
        SessionRecord(session_id="s-fresh", pod="p-1", node="n-1", generation=1),
    ]

    async def page(query: SessionsQuery) -> SessionsPage:
        return SessionsPage(sessions=records)

    await bus.serve(subjects.command("checkpoint", "sessions"), page, (SessionsQuery,))
    await bus.publish(
        SessionRestored(
            session_id="s-here", checkpoint_id="c-1", pod="p-2", node="n-2", generation=2, tokens_recomputed=12
        )
    )
    await bus.publish(SessionRestored(session_id="s-moved", checkpoint_id="c-2", pod="p-2", node="n-2", generation=2))

    views = {v.id: v for v in await read_sessions(MeshClient(settings, bus, redis_client, None))}
    assert (views["s-here"].verified_after_restore, views["s-here"].restored_generation) == (True, None)
    assert views["s-here"].restored_from == "c-1" and views["s-here"].tokens_recomputed == 12
    assert views["s-moved"].tokens_recomputed is None and views["s-fresh"].tokens_recomputed is None
    assert (views["s-moved"].verified_after_restore, views["s-moved"].restored_generation) == (None, 2)
    assert (views["s-fresh"].verified_after_restore, views["s-fresh"].restored_generation) == (None, None)
