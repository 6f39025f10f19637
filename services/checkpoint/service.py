"""The checkpoint service: on every drain, every session on the node is committed before anyone evicts a pod.

It decides, orders, verifies and records; the bytes go from each pod's KV agent straight to the store. This
module is its wiring: it opens its ports over ``ctx.backends`` (``adapters.py``), builds the parts that decide,
each over the one ``Replica`` (``replica.py``), and hands them their consumers, requests, routes and loops:

- ``drain.py``: a node's drain, from its request to its one verdict (``drain.completed`` / ``drain.failed``);
- ``saves.py``: a pod's save commanded, and whether each checkpoint it reports is committed (verified in the
  store, fenced by generation, recorded), preStop reports included;
- ``restore.py``: where a session restores from, and the claims that hand out its generations;
- ``announcements.py``: what each pod holds, from its announcements; ``pods.py``: which pods are gone;
- ``periodic.py``: periodic saves, and their sharing between replicas; ``gpu_failures.py``: saves of the pods on
  a GPU that failed;
- ``retention.py``: which checkpoints and packs go, and ended sessions' checkpoints;
- ``scrub.py``: the registry reconciled with the store (recorded checkpoints whose files are gone are forgotten,
  their sessions' next saves made full);
- ``queries.py``: where a session is, pages of sessions, the fleet's counts, ``GET /sessions/<id>``;
- ``rollout.py``: model rollouts; ``metrics.py``: the metrics; ``ports.py``: the Protocols they depend on, which
  the Redis adapters ``registry.py`` (sessions, checkpoints) and ``leases.py`` (drains, turns, replicas) satisfy.

Sessions are owned: a pod takes one by claiming it (``locate`` with ``claim``), which hands out the session's
next generation. Saves of an older generation are refused, so a pod that lost a session never rolls it back,
and restores use the checkpoints newest (generation, sequence) first. Routers: every change of where a session's
KV is is published once as ``kv.session.location``; ``kv.session.where`` over the bus and ``GET /sessions/<id>``
on the HTTP endpoint answer where it is now.
"""

from __future__ import annotations

import os
import uuid

from shared.contract.checkpoint import (
    AgentSessions,
    LocateCheckpoint,
    SaveSessionsReport,
    SessionRestored,
)
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.device import DeviceHealthChanged
from shared.contract.models import ServingQuery
from shared.contract.node import DrainQuery, DrainRequested
from shared.contract.sessions import (
    FleetQuery,
    SessionsQuery,
    WhereIsSession,
)
from shared.host.runner import ServiceContext
from shared.plumbing.consumer import ConsumerSpec
from shared.ports.cluster import ClusterPort

from .adapters import open_ports
from .announcements import Announcements
from .config import CheckpointSettings, load
from .drain import DrainRunner
from .gpu_failures import GPU_FAILURE_SAVE_S, GpuFailures
from .leases import ReplicaLeases
from .metrics import CheckpointMetrics
from .periodic import PeriodicSaves
from .ports import Store
from .queries import SessionQueries
from .registry import SessionRegistry
from .replica import Replica
from .restore import Restores
from .retention import Retention
from .rollout import RolloutCoordinator
from .saves import Saves
from .scrub import Scrub


class CheckpointService:
    """A store or cluster handed here (tests) is used as is and left open; otherwise both come from
    ``ctx.backends``, as does the Redis client of the registry and the leases, and are closed at stop. No handler
    is written here: the bus, the HTTP endpoint and tests call each part's own (``saves.on_record``,
    ``queries.on_where``, ``retention.collect_garbage``, ...)."""

    name = "checkpoint"
    config_names: tuple[str, ...] = ("checkpoint", "models")

    def __init__(
        self,
        settings: CheckpointSettings | None = None,
        store: Store | None = None,
        cluster: ClusterPort | None = None,
    ) -> None:
        self._settings = settings or load()
        self._store = store
        self.cluster = cluster
        self.owner = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._replica: Replica | None = None

    # The store and the settings live in the replica once started: one handed over later reaches every part.
    @property
    def settings(self) -> CheckpointSettings:
        return self._replica.settings if self._replica else self._settings

    @settings.setter
    def settings(self, settings: CheckpointSettings) -> None:
        self._settings = settings
        if self._replica:
            self._replica.settings = settings

    @property
    def store(self) -> Store | None:
        return self._replica.store if self._replica else self._store

    @store.setter
    def store(self, store: Store) -> None:
        self._store = store
        if self._replica:
            self._replica.store = store

    async def start(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        ports = await open_ports(ctx, self._settings, self._store, self.cluster)
        self.registry: SessionRegistry = ports.registry
        self.leases: ReplicaLeases = ports.leases
        self._store, self.cluster = ports.store, ports.cluster  # a restart of this object uses them again
        metrics = CheckpointMetrics(ctx.telemetry.registry)
        replica = self._replica = Replica(
            ctx, self._settings, ports.store, ports.registry, ports.leases, ports.cluster, metrics, self.owner
        )
        saves = self.saves = Saves(replica)
        self.retention = Retention(replica)
        self.scrub = Scrub(replica)
        self.announcements = Announcements(replica, self.retention)
        self.restores = Restores(replica)
        self.drain_runner = DrainRunner(replica, saves)
        self.drains = self.drain_runner.states
        self.gpu_failures = GpuFailures(replica, saves)
        self.periodic = PeriodicSaves(replica, saves)
        self.queries = SessionQueries(ports.registry)
        metrics.follow(lambda: self.periodic.share, lambda: replica.policy().periodic_interval_s)

        s = ctx.subjects
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("checkpoint", "drains"),
                filter_subjects=(s.pattern("node.drain.requested"),),
                accepts=(DrainRequested,),
                stream=s.events_stream,
                ack_wait=max(5.0, self._settings.drain_lease_s),
                concurrency=4,
                max_deliver=20,
                backoff=(1.0, 2.0, 4.0),
                on_refused=self.drain_runner.on_drain_refused,
            ),
            self.drain_runner.on_drain_requested,
        )
        await ctx.consume(
            ConsumerSpec(
                durable=s.durable("checkpoint", "gpu-failures"),
                filter_subjects=(s.pattern("device.health.changed"),),
                accepts=(DeviceHealthChanged,),
                stream=s.events_stream,
                ack_wait=GPU_FAILURE_SAVE_S * 3,
                concurrency=4,
                max_deliver=3,
            ),
            self.gpu_failures.on_gpu_health,
        )
        # announcements arrive on the pod's own subject; the bus refuses a body naming another pod
        announce = self.announcements.on_announcement
        await ctx.bus.serve(s.pattern("checkpoint.agent.sessions"), announce, (AgentSessions,), queue="checkpoint")
        # What a pod's KV agent asks, on subjects naming the pod: the body must name the same pod.
        for verb, responder, accepts in (
            ("locate", self.restores.on_locate, (LocateCheckpoint,)),
            ("restored", self.restores.on_restored, (SessionRestored,)),
            ("record", saves.on_record, (SaveSessionsReport,)),
        ):
            await ctx.bus.serve(s.agent_commands(verb), responder, accepts, queue="checkpoint", scope_field="pod")
        queries = self.queries
        await ctx.bus.serve(s.command("checkpoint", "where"), queries.on_where, (WhereIsSession,), queue="checkpoint")
        await ctx.bus.serve(
            s.command("checkpoint", "sessions"), queries.on_sessions_query, (SessionsQuery,), queue="checkpoint"
        )
        await ctx.bus.serve(s.command("checkpoint", "fleet"), queries.on_fleet_query, (FleetQuery,), queue="checkpoint")
        await ctx.bus.serve(
            s.command("checkpoint", "drain"), self.drain_runner.on_drain_query, (DrainQuery,), queue="checkpoint"
        )
        self.rollouts = RolloutCoordinator(ctx, ports.config, ports.leases, ports.cluster, self.owner)
        await ctx.bus.serve(
            s.agent_commands("serving"),
            self.rollouts.on_serving_query,
            (ServingQuery,),
            queue="checkpoint",
            scope_field="pod",
        )
        ctx.config.on_change(self.rollouts.wake)
        ctx.spawn(self.rollouts.loop, "checkpoint-rollouts")
        ctx.status["rollouts"] = self.rollouts.running
        ctx.add_route("/sessions/", queries.on_http_session)
        ctx.status["drains"] = self.drains
        ctx.status["store"] = ports.store.url
        if self._settings.gc_interval_s > 0:
            ctx.spawn(self.retention.loop, "checkpoint-gc")
        if self._settings.scrub_interval_s > 0:
            ctx.spawn(self.scrub.loop, "checkpoint-scrub")
        ctx.spawn(self.periodic.loop, "checkpoint-periodic")

    def policy(self) -> CheckpointPolicy:
        """The ``checkpoint`` document in force (its defaults until one is written); once started."""
        assert self._replica is not None, "the checkpoint service has not started"
        return self._replica.policy()
