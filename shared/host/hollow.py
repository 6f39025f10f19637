"""Hollow nodes: the agents of many nodes of one service kind in one process, as kubemark's hollow nodes and KWOK
play a Kubernetes fleet without machines.

A node-scoped service (driver, device, metrics) runs once per node in a real cluster. With
``GPUWARDEN_HOLLOW_NODES`` (``node-1,node-7`` or ``node-[1-1000]``) its ``__main__`` runs a ``HollowHost`` instead:
one instance of the service per node, each started by its own ``start(ctx)`` on a context of its own
(``HollowNodeContext``: the node's settings, status, loops and stop hooks). It is the code a real node runs, on the
same subjects with the same protocol. What the instances share is the process's:

- one NATS connection: each node's bus is a view of it (``Bus.view``) whose events name the node as their source;
- one Redis pool: every client an agent or adapter of the host opens is one over it (``share_redis_pool``);
- one configuration watcher: the documents are the cluster's, not a node's;
- one durable consumer per family of node-scoped consumers (``NodeScope``): the thousand ``device-cordon-<node>``
  consumers of a thousand nodes are one consumer of every node's cordons, each event handed to the instance of
  the node it names; a consumer every instance would share by name (the driver's drain verdicts) is taken once,
  by the host's first node's instance (it starts before the others);
- the ports its backends build for all (``HostBackends``; in simulation one cluster informer and one reader of
  every node's GPU health stream, ``shared.wiring.HollowWiring``);
- one HTTP endpoint: ``/healthz`` sums the nodes up and names those not ok, ``/nodes`` gives each node's status,
  ``/nodes/<node>/healthz`` and ``/nodes/<node>/metrics`` one node's health and metrics as its own process would
  answer them (``/metrics`` is the host's: its connection, consumers and configuration).

So an idle node costs what its own loops do, and nothing per node is polled every second by the host. The host's
first node (``HollowPlan.instance(first=True)``) takes the work one instance does for the whole host (the driver's
upgrade coordinator, the metrics aggregate over the bus). A node whose service fails to start is started again
with a growing delay, as a process manager restarts a process, while the others run on. Hollow nodes are a
simulation (``GPUWARDEN_BACKEND=sim``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shared.contract.base import Event, id_problem, subject_token
from shared.contract.config import ConfigApplied
from shared.contract.subjects import Subjects
from shared.host.runner import Service, ServiceContext, run_main
from shared.plumbing import logs
from shared.plumbing.bus import Bus, Handler
from shared.plumbing.configsync import ConfigWatcher, VersionedConfig, share_redis_pool, warm_pool
from shared.plumbing.consumer import Consumer, ConsumerSpec, consume
from shared.plumbing.errors import SettingsError, TemporaryError
from shared.plumbing.http import Response, SmallHttpServer
from shared.plumbing.settings import Parse, Settings, count, documented, load_settings, setting
from shared.plumbing.telemetry import Telemetry
from shared.ports.backends import Backends

log = logging.getLogger(__name__)

START_AT_ONCE = 16
"""Nodes whose services start at the same time while the host comes up."""
FAMILY_CONCURRENCY = 32
"""Handlers a shared node consumer runs at once (one node's consumer runs its own ``concurrency``)."""
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
NOT_OK_SHOWN = 50
"""Nodes not ok that ``/healthz`` names; the rest are counted."""
_RANGE = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<low>\d+)-(?P<high>\d+)\](?P<suffix>[^\[\]]*)$")


def parse_nodes(raw: str, name: str = "GPUWARDEN_HOLLOW_NODES") -> list[str]:
    """Node names from ``node-1,node-7`` or ``node-[1-1000]`` (a range of numbers, as Slurm writes host lists), or
    both mixed. Each must be a valid node name, none listed twice; ``SettingsError`` names what is wrong."""
    nodes: list[str] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        ranged = _RANGE.match(item)
        if ranged is None:
            if "[" in item or "]" in item:
                raise SettingsError(f"{name}: {item!r} is not a range such as node-[1-1000]")
            nodes.append(item)
            continue
        low, high = int(ranged["low"]), int(ranged["high"])
        if low > high:
            raise SettingsError(f"{name}: {item!r} counts down ({low} > {high})")
        nodes += [f"{ranged['prefix']}{n}{ranged['suffix']}" for n in range(low, high + 1)]
    seen: set[str] = set()
    for node in nodes:
        problem = id_problem("node", node)
        if problem:
            raise SettingsError(f"{name}: {problem}")
        if node in seen:
            raise SettingsError(f"{name}: node {node!r} is listed twice")
        seen.add(node)
    if not nodes:
        raise SettingsError(f"{name}: no node named")
    return nodes


def node_list(nodes: list[str]) -> str:
    """``nodes`` as ``parse_nodes`` reads them, short: runs of three or more names numbered one after another
    (``node-1``, ``node-2``, ...) become a range (``node-[1-1000]``)."""
    items: list[str] = []
    run: tuple[str, int, int] | None = None

    def flush() -> None:
        if run is not None:
            prefix, low, high = run
            if high - low >= 2:
                items.append(f"{prefix}[{low}-{high}]")
            else:
                items.extend(f"{prefix}{n}" for n in range(low, high + 1))

    for node in nodes:
        numbered = re.fullmatch(r"(.*?[^0-9])?([1-9][0-9]*|0)", node)
        if numbered is None:
            flush()
            run = None
            items.append(node)
            continue
        prefix, number = numbered[1] or "", int(numbered[2])
        if run is not None and run[0] == prefix and run[2] + 1 == number:
            run = (prefix, run[1], number)
            continue
        flush()
        run = (prefix, number, number)
    flush()
    return ",".join(items)


@dataclass(frozen=True)
class HollowSettings:
    nodes: tuple[str, ...] = setting(
        "GPUWARDEN_HOLLOW_NODES",
        (),
        "driver, device, metrics: run the service once per node named here, every instance in this one process "
        "on one NATS connection and one Redis pool (hollow nodes; simulation only): `node-1,node-2` or "
        "`node-[1-1000]`; unset: one instance, for GPUWARDEN_NODE",
        parse=Parse(lambda name, raw: tuple(parse_nodes(raw, name)), lambda nodes: node_list(list(nodes))),
    )
    """Empty: one node per process (not hollow)."""
    redis_connections: int = setting(
        "GPUWARDEN_HOLLOW_REDIS_CONNECTIONS",
        32,
        "hollow nodes: connections in the process's one Redis pool",
        parse=count(minimum=2),
    )


DOCUMENTED = documented(HollowSettings)
"""Every variable this module reads, as docs/configuration.md lists it (tools.envdoc)."""


class HostBackends(Protocol):
    """The ports of every node of a host, built over what they share."""

    def for_node(self, settings: Settings, bus: Bus) -> Backends:
        """The ports of the node ``settings.node`` names (its ``ctx.backends``)."""
        ...

    async def close(self) -> None:
        """Close what the nodes share, after every node has stopped."""
        ...


HostBackendsFactory = Callable[[Settings, Subjects, Bus], HostBackends]


@dataclass(frozen=True)
class HollowPlan:
    """How a service's ``__main__`` runs it as hollow nodes: ``instance(first)`` makes the service of one node
    (``first`` for the host's first node: see the module); ``backends`` builds the ports the nodes share."""

    instance: Callable[[bool], Service]
    backends: HostBackendsFactory


@dataclass
class HollowNodeContext(ServiceContext):
    """One node's context in a hollow host: its own settings (its node), status, loops and stop hooks, a view of
    the host's bus; ``consume`` goes through the host (see the module)."""

    host: HollowHost | None = None

    async def consume(self, spec: ConsumerSpec, handler: Handler) -> Consumer:
        assert self.host is not None
        return await self.host.consume(self, spec, handler)

    async def sleep(self, period: float) -> None:
        assert self.host is not None
        await asyncio.shield(self.host.next_tick(period))

    def health(self) -> dict[str, Any]:
        found = super().health()
        if self.host is not None:
            found["hollow_host"] = self.host.name
            found["components"]["consumers"] = self.host.consumer_stats()
        return found


class NodeFamily:
    """One durable consumer standing for a family of node-scoped consumers of every node of the host."""

    def __init__(self, host: HollowHost, spec: ConsumerSpec) -> None:
        scope = spec.node_scope
        assert scope is not None
        if spec.on_refused is not None:
            raise ValueError(f"{spec.durable}: a node-scoped consumer cannot answer refusals in a hollow host")
        s = host.subjects
        self.host = host
        self.spec = replace(
            spec,
            durable=f"{scope.family}-{host.name}",
            filter_subjects=tuple(s.pattern(kind) for kind in scope.kinds),
            node_scope=None,
            concurrency=max(spec.concurrency, FAMILY_CONCURRENCY),
        )
        self.handlers: dict[str, Handler] = {}
        self.consumer: Consumer | None = None
        self.foreign = 0

    async def dispatch(self, event: Event) -> None:
        """Idempotent as the node's own handler is: hands ``event`` to the instance of the node it names. An
        event of a node of this host that has not started yet is tried again later; one of another node (another
        host's, a real one) is not this host's business."""
        node = getattr(event, "node", "")
        handler = self.handlers.get(node)
        if handler is not None:
            await handler(event)
        elif node in self.host.nodes:
            raise TemporaryError(f"node {node} of this hollow host has not started yet")
        else:
            self.foreign += 1

    async def open(self) -> None:
        if self.consumer is None:
            self.consumer = await consume(self.host.bus, self.spec, self.dispatch)


@dataclass
class NodeRun:
    """One node of the host: its service and context once started, or why it is not."""

    node: str
    first: bool
    service: Service | None = None
    ctx: HollowNodeContext | None = None
    started: bool = False
    failures: int = 0
    last_error: str = ""
    retry_at: float | None = None

    def status(self) -> str:
        if self.started and self.ctx is not None:
            return str(self.ctx.health()["status"])
        if self.last_error:
            return f"failed to start ({self.failures}x): {self.last_error}"
        return "starting"


@dataclass
class HollowHost:
    """Runs one instance of a service per node in one process; ``start`` then ``stop``. See the module."""

    service: str
    nodes: dict[str, NodeRun]
    plan: HollowPlan
    settings: Settings
    redis_connections: int = 32
    name: str = ""
    subjects: Subjects = field(init=False)
    telemetry: Telemetry = field(init=False)
    bus: Bus = field(init=False)
    config: ConfigWatcher = field(init=False)
    backends: HostBackends = field(init=False)
    families: dict[str, NodeFamily] = field(default_factory=dict)
    shared: dict[str, Consumer] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    started_s: float | None = None
    _http: SmallHttpServer | None = None
    _pool: Any = None
    _retries: set[asyncio.Task[None]] = field(default_factory=set)
    _ticks: dict[float, asyncio.Future[None]] = field(default_factory=dict)

    @classmethod
    def of(
        cls, service: str, nodes: list[str], plan: HollowPlan, settings: Settings, redis_connections: int = 32
    ) -> HollowHost:
        runs = {node: NodeRun(node, first=i == 0) for i, node in enumerate(nodes)}
        name = subject_token(f"hollow-{nodes[0]}-{len(nodes)}").replace(".", "_")
        return cls(service, runs, plan, settings, redis_connections, name)

    @property
    def http_port(self) -> int:
        return self._http.port if self._http is not None else 0

    # -- starting -------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, start every node's service (some at once), then the shared consumers and the endpoint. Runs
        in a task of its own: the Redis pool it shares is set in that task's context, which every node's tasks
        inherit, and nowhere else."""
        await asyncio.create_task(self._start(), name=f"hollow-{self.service}")

    async def _start(self) -> None:
        began = time.monotonic()
        settings = self.settings
        self.subjects = Subjects(settings.root)
        self.telemetry = Telemetry(self.service)
        self._pool = share_redis_pool(settings.redis, self.redis_connections)
        await warm_pool(self._pool, self.redis_connections)
        self.bus = await Bus.connect(settings.nats, self.subjects, f"{self.service}/{self.name}", self.telemetry)
        await self.bus.ensure_streams()
        first = self.plan.instance(True)
        self.config = ConfigWatcher(
            settings.redis, self.subjects, first.config_names, self.telemetry, reread_s=settings.config_reread_s
        )

        async def announce(applied: VersionedConfig) -> None:
            with contextlib.suppress(Exception):
                await self.bus.publish(
                    ConfigApplied(name=applied.name, version=applied.version, service=self.service, node="")
                )

        self.config.on_change(announce)
        await self.config.start()
        self.backends = self.plan.backends(settings, self.subjects, self.bus)
        self._http = SmallHttpServer(self._route)
        await self._http.start(settings.http_host, settings.http_port, settings.http_fd)
        slots = asyncio.Semaphore(START_AT_ONCE)

        async def start_one(run: NodeRun, service: Service | None) -> None:
            async with slots:
                await self._start_node(run, service)

        runs = list(self.nodes.values())
        await start_one(runs[0], first)  # alone: the consumers every instance shares are its, and its work for all
        await asyncio.gather(*(start_one(run, None) for run in runs[1:]))
        for family in self.families.values():
            await family.open()
        self.started_s = time.monotonic() - began
        self.ready.set()
        failed = [r.node for r in runs if not r.started]
        log.info(
            "hollow nodes started",
            extra={
                "hollow_host": self.name,
                "nodes": len(runs),
                "failed": len(failed),
                "seconds": round(self.started_s, 2),
                "http": f"{settings.http_host}:{self.http_port}",
                "consumers": len(self.families) + len(self.shared),
            },
        )

    async def _start_node(self, run: NodeRun, service: Service | None = None) -> None:
        logs.NODE.set(run.node)
        settings = replace(self.settings, node=run.node)
        service = service or self.plan.instance(run.first)
        ctx = HollowNodeContext(
            self.service,
            settings,
            self.subjects,
            self.bus.view(f"{self.service}/{run.node}"),
            self.config,
            Telemetry(self.service),
            host=self,
        )
        ctx._backends = self.backends.for_node(settings, ctx.bus)
        try:
            await service.start(ctx)
        except Exception as exc:  # undo what it started: its loops, ports, subscriptions, its family handlers
            for task in list(ctx._tasks):
                task.cancel()
            await ctx.run_stop_hooks()
            await ctx.bus.close(1.0)
            for family in self.families.values():
                family.handlers.pop(run.node, None)
            run.failures += 1
            run.last_error = f"{type(exc).__name__}: {exc}"
            delay = min(RETRY_FIRST_S * 2 ** (run.failures - 1), RETRY_MAX_S)
            run.retry_at = time.monotonic() + delay
            log.error("node did not start; trying again", extra={"error": run.last_error, "retry_s": delay})
            task = asyncio.create_task(self._retry(run, delay), name=f"hollow-retry-{run.node}")
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)
            return
        run.service, run.ctx, run.started, run.retry_at = service, ctx, True, None
        if run.failures:
            log.info("node started", extra={"after_failures": run.failures})

    async def _retry(self, run: NodeRun, delay: float) -> None:
        """The next try at a node that did not start. Hand-written, not a ``shared.plumbing.retries`` policy: the
        first try runs in the host's start with the other nodes', each later one in a task of its own, and the
        node's failures and next try are what ``/nodes`` shows."""
        await asyncio.sleep(delay)
        await self._start_node(run)
        if run.started:
            for family in self.families.values():
                await family.open()

    # -- what a node's context asks of the host -------------------------------------------------------------------
    def next_tick(self, period: float) -> asyncio.Future[None]:
        """Done at the next multiple of ``period`` on the loop's clock: one timer for every node's loop of that
        period (``HollowNodeContext.sleep``)."""
        tick = self._ticks.get(period)
        if tick is None or tick.done():
            loop = asyncio.get_running_loop()
            tick = self._ticks[period] = loop.create_future()
            loop.call_at((math.floor(loop.time() / period) + 1) * period, _done, tick)
        return tick

    async def consume(self, ctx: HollowNodeContext, spec: ConsumerSpec, handler: Handler) -> Consumer:
        """A node-scoped consumer joins its family (opened once the host has started its nodes); any other is
        consumed once per host, by the first instance that asks for it: the host's first node's, which starts
        before the others."""
        scope = spec.node_scope
        if scope is None:
            found = self.shared.get(spec.durable)
            if found is None:
                found = self.shared[spec.durable] = await consume(self.bus, spec, handler)
            return found
        if scope.node != ctx.node:
            raise ValueError(f"{spec.durable}: a consumer of node {scope.node} asked for by node {ctx.node}")
        family = self.families.get(scope.family)
        if family is None:
            family = self.families[scope.family] = NodeFamily(self, spec)
        family.handlers[scope.node] = handler
        return family.consumer or Consumer(spec=family.spec)

    def consumer_stats(self) -> dict[str, Any]:
        consumers = [
            *(f.consumer for f in self.families.values() if f.consumer is not None),
            *self.shared.values(),
        ]
        return {
            c.spec.durable: {
                "handled": c.stats.handled,
                "retried": c.stats.retried,
                "dead_lettered": c.stats.dead_lettered,
                "last_error": c.stats.last_error or None,
            }
            for c in consumers
        }

    # -- health ---------------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        statuses = {node: run.status() for node, run in self.nodes.items()}
        not_ok = {node: status for node, status in statuses.items() if status != "ok"}
        connected = self.bus.connected and self.config.connected
        return {
            "service": self.service,
            "hollow_host": self.name,
            "status": "ok" if connected and not not_ok else "degraded",
            "simulated": self.settings.simulated,
            "nodes": len(statuses),
            "nodes_ok": len(statuses) - len(not_ok),
            "not_ok": dict(list(not_ok.items())[:NOT_OK_SHOWN]),
            "started_s": None if self.started_s is None else round(self.started_s, 3),
            "components": {
                "nats": {"ok": self.bus.connected},
                "redis": {"ok": self.config.connected, "error": self.config.last_error or None},
                "consumers": self.consumer_stats(),
            },
            "config_versions": {
                name: (v.version if (v := self.config.current(name)) else None) for name in self.config.names
            },
        }

    async def _route(self, method: str, path: str) -> Response:
        if method != "GET":
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == "/healthz":
            return "200 OK", "application/json", json.dumps(self.health()).encode()
        if path == "/readyz":  # cheap: asked often, while a thousand nodes start
            ok = self.ready.is_set() and self.bus.connected
            started = sum(1 for run in self.nodes.values() if run.started)
            body = json.dumps({"ready": ok, "nodes": len(self.nodes), "started": started}).encode()
            return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.telemetry.registry)
        if path == "/nodes":
            body = json.dumps({node: run.status() for node, run in self.nodes.items()}).encode()
            return "200 OK", "application/json", body
        parts = path.split("/", 3)  # "", "nodes", node, rest
        if len(parts) == 4 and parts[1] == "nodes" and parts[2] in self.nodes:
            run = self.nodes[parts[2]]
            if run.ctx is None or not run.started:
                return "503 Service Unavailable", "application/json", json.dumps({"status": run.status()}).encode()
            rest = "/" + parts[3]
            if rest == "/healthz":
                return "200 OK", "application/json", json.dumps(run.ctx.health()).encode()
            if rest == "/metrics":
                return "200 OK", CONTENT_TYPE_LATEST, generate_latest(run.ctx.telemetry.registry)
            for prefix, route in run.ctx._routes.items():
                if rest.startswith(prefix):
                    return await route(method, rest)
        known = "/healthz, /readyz, /metrics, /nodes, /nodes/<node>/healthz, /nodes/<node>/metrics"
        return "404 Not Found", "text/plain", f"try {known}\n".encode()

    # -- stopping -------------------------------------------------------------------------------------------------
    async def stop(self, grace: float = 10.0) -> None:
        """Stop taking messages, stop every node (its loops, then its stop hooks), then what the nodes share."""
        log.info("stopping", extra={"hollow_host": self.name, "grace_s": grace})
        opened = vars(self)  # a host that failed to start has only some of its parts
        for task in list(self._retries):
            task.cancel()
        consumers = [f.consumer for f in self.families.values() if f.consumer is not None]
        await asyncio.gather(*(c.stop(grace) for c in [*consumers, *self.shared.values()]), return_exceptions=True)
        contexts = [run.ctx for run in self.nodes.values() if run.ctx is not None]
        tasks = [task for ctx in contexts for task in ctx._tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        await asyncio.gather(*(ctx.run_stop_hooks() for ctx in contexts), return_exceptions=True)
        await asyncio.gather(*(ctx.bus.close(grace) for ctx in contexts), return_exceptions=True)
        if "backends" in opened:
            with contextlib.suppress(Exception):
                await self.backends.close()
        if "config" in opened:
            await self.config.stop()
        if "bus" in opened:
            await self.bus.close(grace)
        if self._http is not None:
            await self._http.stop()
        if self._pool is not None:
            with contextlib.suppress(Exception):
                await self._pool.aclose()


def _done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def run_hollow(service: str, hollow: HollowSettings, plan: HollowPlan, env: Mapping[str, str]) -> int:
    """Run the hollow host of the nodes ``hollow`` names until SIGTERM or SIGINT; returns the process exit code."""
    nodes = list(hollow.nodes)
    try:
        settings = load_settings(env)
        if not settings.simulated:
            raise SettingsError("GPUWARDEN_HOLLOW_NODES: hollow nodes are simulated nodes (GPUWARDEN_BACKEND=sim)")
    except SettingsError as exc:
        logs.configure(service)
        print(f"{service}: {exc}", file=sys.stderr)
        return 2
    logs.configure(service, settings.log_level, settings.simulated)
    log.info("hollow nodes: SIMULATED", extra={"nodes": len(nodes), "first": nodes[0], "last": nodes[-1]})

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        host = HollowHost.of(service, nodes, plan, settings, hollow.redis_connections)
        try:
            await host.start()
        except Exception as exc:
            log.error("could not start", extra={"error": f"{type(exc).__name__}: {exc}"})
            await host.stop(grace=1.0)
            return 1
        await stop.wait()
        await host.stop()
        log.info("stopped")
        return 0

    return run_main(main())
