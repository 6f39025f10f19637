"""The one way a service starts: settings, JSON logs, the bus, the config watcher, an HTTP endpoint, signals.

A service is a small object with a ``name``, the configuration documents it reads, and ``start(ctx)`` that
subscribes its handlers and spawns its loops. It reaches hardware and the cluster through ``ctx.backends``, the
ports the composition root (``shared.wiring``, handed to ``run`` by the service's ``__main__``) builds from the
settings. What it opens it hands to ``ctx.on_stop``. The runner does the rest and shuts everything down in order:
stop taking messages, let in-flight handlers finish (or nak them), stop loops, run the stop hooks (newest first),
close connections.

HTTP: ``/healthz`` answers 200 while the process runs, with ``"status": "ok"`` or ``"degraded"`` and each
component's state (Redis down is degraded: the service keeps going on its last good configuration);
``/readyz`` answers 200 once started and while NATS is connected, 503 otherwise; ``/metrics`` is Prometheus.
A service adds its own read-only routes with ``ctx.add_route(prefix, route)`` on the same server.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shared.contract.base import Event
from shared.contract.config import ConfigApplied
from shared.contract.permissions import NODE_SCOPED
from shared.contract.subjects import Subjects
from shared.plumbing import logs
from shared.plumbing.bus import Bus, Handler
from shared.plumbing.configsync import ConfigWatcher, VersionedConfig
from shared.plumbing.consumer import Consumer, ConsumerSpec, consume
from shared.plumbing.errors import SettingsError
from shared.plumbing.http import Response, Route, SmallHttpServer
from shared.plumbing.retries import LOOP_RESTART
from shared.plumbing.settings import Settings, load_settings
from shared.plumbing.telemetry import Telemetry
from shared.ports.backends import Backends

log = logging.getLogger(__name__)

STOP_HOOK_TIMEOUT_S = 5.0
"""How long one stop hook may take; past it, shutdown goes on without it (logged)."""

EXIT_TASKS_S = 2.0
"""At the end of ``run``, how long the tasks still running after the service stopped (a library's own, a loop's
child it did not await) get to end once cancelled; past it the process exits without them (logged)."""

BackendsFactory = Callable[[Settings, Subjects, Bus], Backends]
"""How the runner gets a service's ports: ``shared.wiring.Wiring`` in every ``__main__``; tests may hand their own."""

StopHook = Callable[[], Any]
"""A callable run once at stop: plain, or returning an awaitable (``port.close``)."""

_Hook = TypeVar("_Hook", bound=StopHook)


class Service(Protocol):
    """``name``, the configuration documents it reads, and ``start``. A service may also say ``bus_only = True``:
    it needs NATS alone (the auth callout), so the runner ensures no stream and watches no configuration."""

    name: str
    config_names: tuple[str, ...]

    async def start(self, ctx: ServiceContext) -> None: ...


@dataclass
class ServiceContext:
    """What a running service gets: its settings, names, bus, configuration, telemetry and a place for loops."""

    service: str
    settings: Settings
    subjects: Subjects
    bus: Bus
    config: ConfigWatcher
    telemetry: Telemetry
    status: dict[str, Any] = field(default_factory=dict)  # shown in /healthz; callables are called each time
    _backends: Backends | None = None
    _stop_hooks: list[StopHook] = field(default_factory=list)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _consumers: list[Consumer] = field(default_factory=list)
    _routes: dict[str, Route] = field(default_factory=dict)

    @property
    def node(self) -> str:
        return self.settings.node

    @property
    def backends(self) -> Backends:
        """The ports of this process, real or simulated, as the composition root built them."""
        if self._backends is None:
            raise RuntimeError(
                f"{self.service}: started without backends; start it with run(service, Wiring) or "
                "start_service(service, settings, Wiring) (shared.wiring), or hand it its ports"
            )
        return self._backends

    def on_stop(self, hook: _Hook) -> _Hook:
        """Run ``hook`` once when the service stops, after its consumers and loops have stopped: ports a service
        opens at start are closed here, never by a loop (a loop the runner restarts keeps using them). Hooks run
        newest first; one that fails or hangs (past ``STOP_HOOK_TIMEOUT_S``) is logged and the rest still run."""
        self._stop_hooks.append(hook)
        return hook

    async def run_stop_hooks(self) -> None:
        """Runs (and forgets) every stop hook, newest first; never raises."""
        while self._stop_hooks:
            hook = self._stop_hooks.pop()
            name = getattr(hook, "__qualname__", repr(hook))
            try:
                result = hook()
                if inspect.isawaitable(result):
                    await asyncio.wait_for(asyncio.ensure_future(result), STOP_HOOK_TIMEOUT_S)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                log.warning("stop hook cancelled", extra={"hook": name})
            except Exception as exc:
                log.warning("stop hook failed", extra={"hook": name, "error": f"{type(exc).__name__}: {exc}"})

    async def sleep(self, period: float) -> None:
        """Wait between two rounds of a periodic loop that runs every ``period`` seconds. One node's process
        sleeps ``period``; a process hosting many nodes (``shared.host.hollow``) wakes the loops of all its
        nodes with the same period together, on one timer, at the next multiple of the period (the first wait may
        be shorter), so that a thousand nodes' rounds are one wakeup and their reads can share round trips."""
        await asyncio.sleep(period)

    def spawn(self, factory: Callable[[], Awaitable[Any]], name: str) -> asyncio.Task[Any]:
        """Run a background loop for the service's lifetime. A loop that crashes is logged and started again
        from ``factory`` with a growing delay (``retries.LOOP_RESTART``): a service never dies of one bad
        iteration. So a loop closes nothing it did not open itself in that run: what outlives one run is closed
        by ``on_stop``."""

        def crashed(exc: Exception, wait_s: float) -> None:
            log.error("background loop crashed; restarting", exc_info=exc, extra={"loop": name})

        async def guarded() -> None:
            await LOOP_RESTART.call(factory, note=crashed)

        task = asyncio.create_task(guarded(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def consume(self, spec: ConsumerSpec, handler: Handler) -> Consumer:
        consumer = await consume(self.bus, spec, handler)
        self._consumers.append(consumer)
        return consumer

    async def publish(self, event: Event) -> None:
        await self.bus.publish(event)

    def add_route(self, prefix: str, route: Route) -> None:
        """Answer GET requests for paths under ``prefix`` (``"/sessions/"``) on the service's HTTP endpoint;
        ``route`` gets the method and the path (without the query) and returns (status line, type, body)."""
        if not prefix.startswith("/") or prefix in ("/healthz", "/readyz", "/metrics"):
            raise ValueError(f"HTTP route prefix {prefix!r}: must start with '/' and not shadow the probes")
        self._routes[prefix] = route

    def health(self) -> dict[str, Any]:
        components = {
            "nats": {"ok": self.bus.connected},
            "redis": {"ok": self.config.connected, "error": self.config.last_error or None},
            "consumers": {
                c.spec.durable: {
                    "handled": c.stats.handled,
                    "retried": c.stats.retried,
                    "dead_lettered": c.stats.dead_lettered,
                    "last_error": c.stats.last_error or None,
                }
                for c in self._consumers
            },
        }
        configs = {name: (v.version if (v := self.config.current(name)) else None) for name in self.config.names}
        degraded = not (self.bus.connected and self.config.connected)
        return {
            "service": self.service,
            "node": self.node,
            "status": "degraded" if degraded else "ok",
            "simulated": self.settings.simulated,
            "components": components,
            "config_versions": configs,
            **{key: value() if callable(value) else value for key, value in self.status.items()},
        }


class HealthServer(SmallHttpServer):
    """``/healthz``, ``/readyz`` and ``/metrics`` of a service."""

    def __init__(self, ctx: ServiceContext, ready: asyncio.Event) -> None:
        super().__init__(self._route)
        self.ctx = ctx
        self.ready = ready

    async def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method != "GET":
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == "/healthz":
            return "200 OK", "application/json", json.dumps(self.ctx.health()).encode()
        if path == "/readyz":
            ok = self.ready.is_set() and self.ctx.bus.connected
            body = json.dumps({"ready": ok, "status": self.ctx.health()["status"]}).encode()
            return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.ctx.telemetry.registry)
        for prefix, route in self.ctx._routes.items():
            if path.startswith(prefix):
                return await self._added(route, method, path)
        known = ", ".join(["/healthz", "/readyz", "/metrics", *(f"{p}..." for p in self.ctx._routes)])
        return "404 Not Found", "text/plain", f"try {known}\n".encode()

    @staticmethod
    async def _added(route: Route, method: str, path: str) -> Response:
        """A service's own route; one that raises answers 500 with one line, never a dropped connection."""
        try:
            return await route(method, path)
        except Exception as exc:
            log.exception("HTTP route failed", extra={"path": path})
            return "500 Internal Server Error", "text/plain", f"{type(exc).__name__}: {exc}\n".encode()


class RunningService:
    """A started service; ``stop()`` shuts it down in order. Tests start services this way, in-process."""

    def __init__(self, ctx: ServiceContext, http: HealthServer) -> None:
        self.ctx = ctx
        self.http = http

    @property
    def http_port(self) -> int:
        return self.http.port

    async def stop(self, grace: float = 10.0) -> None:
        log.info("stopping", extra={"grace_s": grace})
        await asyncio.gather(*(c.stop(grace) for c in self.ctx._consumers), return_exceptions=True)
        for task in list(self.ctx._tasks):
            task.cancel()
        if self.ctx._tasks:
            await asyncio.wait(list(self.ctx._tasks), timeout=5.0)
        await self.ctx.run_stop_hooks()
        await self.ctx.config.stop()
        await self.ctx.bus.close(grace)
        await self.http.stop()


async def start_service(
    service: Service, settings: Settings, backends: BackendsFactory | None = None
) -> RunningService:
    """Connect, load configuration, build the service's ports (``backends``), start its handlers and the HTTP
    endpoint. A service that fails to start has its stop hooks run before the error goes up."""
    subjects = Subjects(settings.root)
    telemetry = Telemetry(service.name)
    # A node-scoped service speaks for its node (``driver/node-3``); any other one for the cluster: the node its
    # replica happens to run on is no part of its name, which an events table would read as the node concerned.
    source = f"{service.name}/{settings.node}" if settings.node and service.name in NODE_SCOPED else service.name
    bus = await Bus.connect(settings.nats, subjects, source, telemetry)
    bus_only = bool(getattr(service, "bus_only", False))
    if not bus_only:
        await bus.ensure_streams()
    config = ConfigWatcher(settings.redis, subjects, service.config_names, telemetry, reread_s=settings.config_reread_s)
    ctx = ServiceContext(service.name, settings, subjects, bus, config, telemetry)
    if backends is not None:
        ctx._backends = backends(settings, subjects, bus)

    async def announce(applied: VersionedConfig) -> None:
        with contextlib.suppress(Exception):
            await bus.publish(
                ConfigApplied(name=applied.name, version=applied.version, service=service.name, node=settings.node)
            )

    config.on_change(announce)
    if bus_only:
        config.connected = True  # nothing to watch: Redis is not this service's to need
    else:
        await config.start()
    ready = asyncio.Event()
    http = HealthServer(ctx, ready)
    await http.start(settings.http_host, settings.http_port, settings.http_fd)
    try:
        await service.start(ctx)
    except BaseException:
        for task in list(ctx._tasks):
            task.cancel()
        await ctx.run_stop_hooks()
        raise
    ready.set()
    log.info(
        "started",
        extra={
            "http": f"{settings.http_host}:{http.port}",
            "root": settings.root,
            "node": settings.node,
            "backend": settings.backend,
            "nats": list(settings.nats.servers),
        },
    )
    return RunningService(ctx, http)


def run(service: Service, backends: BackendsFactory | None = None, settings: Settings | None = None) -> int:
    """Run ``service`` with the ports ``backends`` builds until SIGTERM or SIGINT; returns the process exit
    code."""
    try:
        settings = settings or load_settings()
    except SettingsError as exc:
        logs.configure(service.name)
        log.error("bad settings", extra={"error": str(exc)})
        print(f"{service.name}: {exc}", file=sys.stderr)
        return 2
    logs.configure(service.name, settings.log_level, settings.simulated)
    if settings.simulated:
        log.info("backend: SIMULATED GPUs and cluster (GPUWARDEN_BACKEND=sim)")

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            running = await start_service(service, settings, backends)
        except Exception as exc:
            log.error("could not start", extra={"error": f"{type(exc).__name__}: {exc}"})
            return 1
        await stop.wait()
        await running.stop()
        log.info("stopped")
        return 0

    return run_main(main())


def run_main(main: Coroutine[Any, Any, int]) -> int:
    """``asyncio.run(main)`` for a process that runs services: the same, but its end never waits without end
    (``close_promptly``)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        close_promptly(loop)


def close_promptly(loop: asyncio.AbstractEventLoop, tasks_s: float = EXIT_TASKS_S) -> None:
    """Close ``loop`` as ``asyncio.run`` does, but never wait without end: the tasks still running are cancelled
    and get ``tasks_s`` to end, and the default executor's threads (a blocking call, such as a DNS lookup, that a
    stopped service no longer waits for) are not waited for: they end with the process. ``gpuwarden down`` waits
    for every process it stopped, so a service's exit is not to hang on either."""
    try:
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            _, stuck = loop.run_until_complete(asyncio.wait(pending, timeout=tasks_s))
            if stuck:
                names = sorted(task.get_name() for task in stuck)
                log.warning("tasks still running at exit; leaving them", extra={"tasks": names})
        with contextlib.suppress(Exception):
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), tasks_s))
    finally:
        asyncio.set_event_loop(None)
        loop.close()  # shuts the default executor down without waiting for its threads
