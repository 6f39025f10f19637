"""The checkpoint service's ports, opened over what ``ctx.backends`` hands it: the checkpoint store the settings
name, the session registry (``registry.py``) and the leases (``leases.py``), the adapters over one Redis client,
and the cluster port.
A store or cluster handed to the service by its caller is used as is and left open: only what is opened here is
closed at stop."""

from __future__ import annotations

from dataclasses import dataclass

from shared.host.runner import ServiceContext
from shared.kv.store import CheckpointStore
from shared.plumbing.configsync import ConfigStore
from shared.ports.cluster import ClusterPort

from .config import CheckpointSettings
from .leases import ReplicaLeases
from .ports import Store
from .registry import SessionRegistry


@dataclass(frozen=True)
class OpenedPorts:
    store: Store
    registry: SessionRegistry
    leases: ReplicaLeases
    cluster: ClusterPort
    config: ConfigStore
    """The configuration documents in Redis, over the registry's client (model rollouts write them)."""


async def open_ports(
    ctx: ServiceContext, settings: CheckpointSettings, store: Store | None, cluster: ClusterPort | None
) -> OpenedPorts:
    if store is None:
        opened: CheckpointStore = ctx.backends.checkpoint_store(settings.store)
        ctx.on_stop(opened.close)
        store = opened
    registry = SessionRegistry(ctx.backends.redis(), ctx.subjects)
    ctx.on_stop(registry.client.aclose)
    if cluster is None:
        cluster = await ctx.backends.cluster()
        ctx.on_stop(cluster.close)
    leases = ReplicaLeases(registry.client, ctx.subjects)
    return OpenedPorts(store, registry, leases, cluster, ConfigStore(registry.client, ctx.subjects))
