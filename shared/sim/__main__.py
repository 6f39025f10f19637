"""``python -m shared.sim`` (``gpuwarden sim run``): the SIMULATED cluster, GPUs and inference workload, as one process
on the service runner (health, metrics and JSON logs like the services).

It creates the simulated state in Redis when absent (from ``GPUWARDEN_SIM_SPEC`` or the default spec), and again
whenever Redis comes back without it (restarted without its data), so it never needs a restart of its own; it plays
every pod of the spec's deployments with a real KV agent and the real checkpoint store
(``GPUWARDEN_CHECKPOINT_STORE``), answers fault-injection requests, and, with ``--rate``, sends a steady load of
inference requests: conversations of a few turns each, closed and replaced, enough to fill the pods' KV pools.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis.exceptions

from shared.contract.permissions import AGENT, Identity, identity_name, inbox_prefix
from shared.host.entry import exit_now
from shared.host.runner import ServiceContext, run
from shared.kv.journal import journal_settings
from shared.kv.stores import StoreSettings
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client, warm_pool
from shared.plumbing.settings import Parse, Secret, documented, setting, settings_from_env
from shared.ports.cluster import ClusterError, PodInfo
from shared.sim.cluster import SimCluster
from shared.sim.conversations import publish_requests
from shared.sim.exporter import PodRef, SimExporter, SimExporterHost
from shared.sim.faults import serve_faults
from shared.sim.gateway import GatewayRouting, GatewaySettings
from shared.sim.gauges import WorkloadCollector
from shared.sim.gpus import SimGpus
from shared.sim.informer import SharedSimCluster
from shared.sim.pods import PodLink
from shared.sim.spec import SimSpec, load_spec
from shared.sim.workload import SimWorkload

log = logging.getLogger(__name__)


def _folder(name: str, raw: str) -> Path:
    path = Path(raw)
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class PodIdentitySettings:
    token_dir: Path | None = setting(
        "GPUWARDEN_SIM_TOKEN_DIR",
        None,
        "sim: folder where each SIMULATED pod's service-account token is written, as the kubelet projects it; each "
        "pod's KV agent then connects with it, as its own pod (a secured mesh: gpuwarden up --secure)",
        parse=Parse(_folder),
    )
    """None: every pod's agent speaks on the simulation's own connection."""


DOCUMENTED = documented(PodIdentitySettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""
TOKEN_TTL_S = 3600.0

REDIS_CONNECTIONS = 64
"""The simulation's one Redis pool: a fleet's exporter pages scraped at once wait for a connection, never fail for
want of one."""
ATTACH_AT_ONCE = 64
"""Simulated nodes whose GPUs are attached at once at start (a fleet of a thousand attaches in a few rounds)."""


class Simulation:
    name = "sim"
    config_names: tuple[str, ...] = ()

    reseed_s = 2.0
    """How often the simulation checks that its world is still in Redis."""

    def __init__(
        self,
        spec: SimSpec,
        store_url: str,
        rate: float,
        sessions: int,
        prompt: int,
        new: int,
        max_turns: int = 12,
        token_dir: Path | None = None,
        gateway: GatewaySettings | None = None,
    ) -> None:
        self.spec = spec
        self.gateway = gateway or GatewaySettings()
        """Whether requests go through the endpoint picker (``GPUWARDEN_SIM_ROUTER``), or the workload routes."""
        self.token_dir = token_dir
        self.store_url = store_url
        self.rate = rate
        self.sessions = sessions
        self.prompt = prompt
        self.new = new
        self.max_turns = max_turns
        self.workload: SimWorkload | None = None
        self.exporters: SimExporterHost | None = None

    async def start(self, ctx: ServiceContext) -> None:
        from shared.kv.stores import open_store

        client = redis_client(ctx.settings.redis, max_connections=REDIS_CONNECTIONS)
        await warm_pool(client, REDIS_CONNECTIONS)
        cluster = await SharedSimCluster.create(client, ctx.subjects, self.spec)
        assert isinstance(cluster, SharedSimCluster)
        cluster.start()  # the workload's reads and watch come from one informer, not from Redis on every tick
        ctx.on_stop(cluster.close)
        ctx.spawn(lambda: self._keep_world(cluster), "sim-world")
        gpus: dict[str, Any] = {n.name: SimGpus(client, ctx.subjects, self.spec, n.name) for n in self.spec.nodes}
        ports = list(gpus.values())
        for start in range(0, len(ports), ATTACH_AT_ONCE):
            await asyncio.gather(*(port.attach() for port in ports[start : start + ATTACH_AT_ONCE]))
        await serve_faults(ctx.bus, client, ctx.subjects, self.spec)
        store = open_store(self.store_url, ctx.bus.nc)
        gateway = GatewayRouting.from_settings(self.gateway)
        journal = journal_settings()
        self.workload = SimWorkload(
            ctx.bus,
            cluster,
            store,
            self.spec,
            gpus=gpus,
            link_pod=lambda pod: self._link(ctx, cluster, store, pod),
            gateway=gateway,
            journal_s=journal.interval_s,
            node_dir=Path(journal.node_dir) if journal.node_dir else None,
            spill_s=journal.spill_s,
            node_budget_bytes=journal.node_budget_mib * 1024 * 1024,
        )
        await self.workload.start()
        ctx.on_stop(self.workload.end_engines)
        ctx.status["simulation"] = self.workload.status
        ctx.telemetry.registry.register(WorkloadCollector(self.workload))
        # a dcgm-exporter page per node, all on one port, each announced in Redis for the metrics service
        exporters = SimExporterHost(
            (SimExporter(port, pods=self._pods_of(name)) for name, port in gpus.items()), client, ctx.subjects
        )
        await exporters.start(ctx.settings.http_host)
        ctx.on_stop(exporters.stop)
        self.exporters = exporters
        ctx.status["exporters"] = {"nodes": len(exporters.exporters), "url": exporters.url("<node>")}
        if self.rate > 0:

            async def load() -> None:
                await publish_requests(
                    ctx.bus,
                    self.spec,
                    self.sessions,
                    self.rate,
                    self.prompt,
                    self.new,
                    seconds=float("inf"),
                    max_turns=self.max_turns,
                )

            ctx.spawn(load, "sim-load")

    async def _link(self, ctx: ServiceContext, cluster: SimCluster, shared: Any, pod: PodInfo) -> PodLink:
        """How ``pod``'s KV agent reaches NATS and the store. With ``token_dir``: a connection of its own, proving
        its pod with the token the SIMULATED cluster issued for it (written to ``<token_dir>/<namespace>_<pod>``
        and read again at every reconnect, as a projected token). A ``nats://`` store writes as the pod; a file
        store is the one all pods share."""
        from shared.kv.stores import open_store, parse_store_url

        bus, own_bus = ctx.bus, False
        if self.token_dir is not None:
            token = await cluster.issue_token(pod.namespace, pod.name, audience="gpuwarden", ttl_s=TOKEN_TTL_S)
            path = self.token_dir / f"{pod.namespace}_{pod.name}"
            path.write_text(token)
            path.chmod(0o600)
            nats = replace(
                ctx.settings.nats,
                user=None,
                password=None,
                token=Secret(token),
                token_file=path,
                inbox_prefix=inbox_prefix(identity_name(ctx.subjects, Identity(AGENT, pod=pod.name))),
            )
            bus = await Bus.connect(nats, ctx.subjects, f"agent/{pod.name}")
            own_bus = True
        if parse_store_url(self.store_url)[0] == "nats":
            return PodLink(bus, open_store(self.store_url, bus.nc, pod=pod.name), own_bus=own_bus)
        return PodLink(bus, shared, own_bus=own_bus, own_store=False)

    async def _keep_world(self, cluster: SimCluster) -> None:
        """Runs for the simulation's lifetime. Redis may come back empty (a restart without persistence, a
        flush): the cluster is made again from the spec and the exporters are announced again, so the workload,
        the services and the CLI find the simulated world where they look. (The GPUs' state is made again by
        ``SimGpus`` on first use.) While Redis is away nothing is done; the config watcher reports it. Not a ``retries``
        policy: a steady check every ``reseed_s``, whose failure only waits for the next one."""
        while True:
            await asyncio.sleep(self.reseed_s)
            try:
                created = not await cluster.present() and await cluster.ensure(self.spec)
                if created:
                    log.warning("SIMULATED cluster was gone from Redis (restarted empty?); made again from the spec")
                if self.exporters is not None and (created or not await self.exporters.announced()):
                    await self.exporters.announce(only_missing=True)
            except (ClusterError, redis.exceptions.RedisError, OSError):
                continue

    def _pods_of(self, node: str) -> Callable[[], dict[str, PodRef]]:
        """The pods using each GPU of ``node``, as the workload placed them (the kubelet's view on a real node)."""

        def pods() -> dict[str, PodRef]:
            if self.workload is None:
                return {}
            return {
                r.gpu_uuid: PodRef(r.info.name, r.info.namespace)
                for r in self.workload.runtimes.values()
                if r.info.node == node and r.gpu_uuid
            }

        return pods


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuwarden sim run", description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--rate", type=float, default=2.0, help="inference requests per second (0: none)")
    parser.add_argument("--sessions", type=int, default=10, help="open conversations per deployment at a time")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per turn")
    parser.add_argument("--new-tokens", type=int, default=32, help="generated tokens per turn")
    parser.add_argument("--max-turns", type=int, default=12, help="turns of a conversation at most (then it closes)")
    args = parser.parse_args(argv)
    for name in ("rate", "sessions", "prompt_tokens", "new_tokens", "max_turns"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    if args.rate > 0 and args.prompt_tokens + args.new_tokens == 0:
        parser.error("--prompt-tokens or --new-tokens must be positive (a request with neither closes its session)")
    try:
        spec = load_spec()
        store = settings_from_env(StoreSettings).url
        token_dir = settings_from_env(PodIdentitySettings).token_dir
        gateway = settings_from_env(GatewaySettings)
    except ValueError as exc:
        print(f"gpuwarden sim run: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        return run(
            Simulation(
                spec,
                store,
                args.rate,
                max(1, args.sessions),
                args.prompt_tokens,
                args.new_tokens,
                max(1, args.max_turns),
                token_dir,
                gateway,
            )
        )
    return 0


if __name__ == "__main__":
    exit_now(main())
