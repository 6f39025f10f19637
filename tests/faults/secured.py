"""The secured mesh the fault suite runs on: a nats-server configured as `gpuwarden nats-auth --issuer-seed-file`
writes it, every client but the auth callout's own user authenticated by the real auth service (services/auth): the
services, the admin and the gateway with their passwords, each inference pod's KV agent with a service-account token
the SIMULATED cluster issued for its pod. The real checkpoint service runs under its own user.

``secured_mesh`` is a fixture of every test under tests/faults (tests/faults/conftest.py imports it); the attacks
(test_attacks_secured.py) and the faults on it (test_faults_secured.py) use it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from services.auth.config import AuthSettings
from services.auth.service import AuthService
from services.checkpoint.config import CheckpointSettings
from services.checkpoint.service import CheckpointService
from shared.console.secure import CalloutSecrets, callout_secrets, write_server_config
from shared.contract.checkpoint import CheckpointLocation, LocateCheckpoint
from shared.contract.configdocs import CheckpointPolicy
from shared.contract.node import DrainCompleted, DrainFailed, DrainRequested
from shared.contract.permissions import ADMIN, AGENT, AUTH, Identity, identity_name, inbox_prefix, user_name
from shared.contract.subjects import Subjects
from shared.host.devservers import NatsServer
from shared.host.runner import RunningService, start_service
from shared.kv.agent import KvAgent
from shared.kv.endpoint import AgentEndpoint
from shared.kv.filestore import FileStore
from shared.kv.store import CheckpointNotFound
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.settings import NatsSettings, Secret, Settings
from shared.sim.cluster import SimCluster
from shared.sim.spec import DeploymentSpec, GpuSpec, NodeSpec, SimSpec
from shared.wiring import Wiring
from tests.faults.checker import Findings, check_invariants
from tests.faults.conftest import Pod
from tests.helpers import eventually
from tests.kvkit import LAYOUT

SPEC = SimSpec(  # one GPU per node: llama-1 on node-1, llama-2 on node-2, a third pod would stay Pending
    nodes=[NodeSpec(name="node-1", gpus=[GpuSpec(count=1)]), NodeSpec(name="node-2", gpus=[GpuSpec(count=1)])],
    deployments=[DeploymentSpec(name="llama", namespace="llm", replicas=2, max_unavailable=1)],
)


@pytest.fixture
def secrets_of_the_mesh(tmp_path: Path) -> CalloutSecrets:
    return callout_secrets(tmp_path / "secure")


@pytest.fixture
def secured(tmp_path: Path, subjects: Subjects, secrets_of_the_mesh: CalloutSecrets) -> Iterator[NatsServer]:
    """A nats-server that knows one user, the callout's; everyone else is the callout's to authenticate."""
    server = NatsServer(config=write_server_config(tmp_path / "nats.conf", subjects, secrets_of_the_mesh))
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@dataclass
class SecuredMesh:
    subjects: Subjects
    settings: Settings
    server: NatsServer
    secrets: CalloutSecrets
    cluster: SimCluster
    store: FileStore
    client: aioredis.Redis
    admin: Bus
    auth: RunningService
    checkpoint: RunningService
    service: CheckpointService
    pods: dict[str, Pod] = field(default_factory=dict)
    errors: dict[str, list[Exception]] = field(default_factory=dict)
    verdicts: list[DrainCompleted | DrainFailed] = field(default_factory=list)
    buses: list[Bus] = field(default_factory=list)

    def as_user(self, name: str, password: str | None = None) -> NatsSettings:
        pw = self.secrets.passwords[name] if password is None else password
        return NatsSettings(servers=(self.server.url,), user=user_name(self.subjects, name), password=Secret(pw))

    def as_token(self, token: str, pod: str = "") -> NatsSettings:
        inbox = inbox_prefix(identity_name(self.subjects, Identity(AGENT, pod=pod))) if pod else ""
        return NatsSettings(servers=(self.server.url,), token=Secret(token), inbox_prefix=inbox)

    async def connect(self, nats_settings: NatsSettings, who: str) -> Bus:
        errors = self.errors.setdefault(who, [])
        bus = await Bus.connect(nats_settings, self.subjects, who, connect_timeout=2.0, on_error=errors.append)
        self.buses.append(bus)
        return bus

    async def refused(self, who: str, what: str, subject: str) -> None:
        """Wait for the server's refusal of ``what`` (publish, subscription) on ``subject`` to ``who``."""
        needle = f'permissions violation for {what} to "{subject}"'.lower()
        await eventually(lambda: any(needle in str(e).lower() for e in self.errors.get(who, [])), timeout=5)

    async def add_pod(
        self, name: str, sessions: list[str], blocks: int = 2, *, journal_s: float = 0.0, prefetch: bool = False
    ) -> Pod:
        """The pod's KV agent under its own token, holding ``sessions`` (``blocks`` each); ``journal_s``: its KV
        journal; ``prefetch``: it answers the router's prefetch commands (restoring into its agent)."""
        info = next(p for p in await self.cluster.pods() if p.name == name)
        token = await self.cluster.issue_token(info.namespace, name, audience="gpuwarden")
        bus = await self.connect(self.as_token(token, name), f"agent/{name}")
        agent = KvAgent(
            self.store, pod=name, node=info.node, namespace=info.namespace, deployment=info.deployment, layout=LAYOUT
        )
        host = RestoringHost() if prefetch else None
        endpoint = AgentEndpoint(agent, bus, announce_s=30, journal_s=journal_s, sessions=host)
        if host is not None:
            host.endpoint = endpoint
        pod = Pod(name, agent, endpoint, bus)
        for sid in sessions:
            await endpoint.start_session(sid)
            pod.grow(sid, blocks)
        await endpoint.start()
        self.pods[name] = pod
        await eventually(lambda: self._registered(name))
        return pod

    async def _registered(self, pod: str) -> bool:
        return pod in await self.service.registry.pods()

    async def sessions_on(self, node: str) -> set[str]:
        return {s.session_id for s in await self.service.registry.sessions_on_node(node)}

    async def drain(self, node: str, drain_id: str) -> DrainCompleted | DrainFailed:
        await self.admin.publish(DrainRequested(node=node, drain_id=drain_id, deadline_s=10))
        return await eventually(lambda: next((v for v in self.verdicts if v.drain_id == drain_id), None), timeout=20)

    async def still_serving(self, pod: str, session: str) -> None:
        """The checkpoint service still answers a pod asking as itself."""
        answer = await self.pods[pod].bus.request(
            self.subjects.agent_command("locate", pod), LocateCheckpoint(session_id=session, pod=pod), 5
        )
        assert isinstance(answer, CheckpointLocation), answer

    async def check(self, *, min_checkpoints: int, **kwargs: object) -> Findings:
        kwargs.setdefault("verdicts", self.verdicts)
        found = await check_invariants(
            self.store,
            self.client,
            self.subjects,
            min_checkpoints=min_checkpoints,
            **kwargs,  # type: ignore[arg-type]
        )
        assert found, "\n".join(found.problems)
        return found


class RestoringHost:
    """A pod's ``SessionHost`` with no engine beside the agent: a prefetched session is restored into the agent,
    through the pod's own restore path as a prefetch."""

    def __init__(self) -> None:
        self.endpoint: AgentEndpoint | None = None

    async def prefetch(self, session_id: str) -> bool:
        assert self.endpoint is not None
        if session_id in self.endpoint.agent.sessions():
            return False
        try:
            await self.endpoint.restore(session_id, prefetch=True)
        except CheckpointNotFound:  # held fresh: nothing to restore
            pass
        return True


@pytest.fixture
async def secured_mesh(
    secured: NatsServer,
    secrets_of_the_mesh: CalloutSecrets,
    subjects: Subjects,
    settings: Settings,
    tmp_path: Path,
    redis_client: aioredis.Redis,
) -> AsyncIterator[SecuredMesh]:
    cluster = await SimCluster.create(settings.redis, subjects, SPEC)
    auth_settings = AuthSettings(
        issuer_seed_file=secrets_of_the_mesh.seed, password_dir=secrets_of_the_mesh.folder, bucket=bucket_of(subjects)
    )
    nats_of = lambda name: NatsSettings(  # noqa: E731
        servers=(secured.url,), user=user_name(subjects, name), password=Secret(secrets_of_the_mesh.passwords[name])
    )
    auth = await start_service(AuthService(auth_settings), replace(settings, nats=nats_of(AUTH)), Wiring)
    admin = await Bus.connect(nats_of(ADMIN), subjects, "admin", connect_timeout=2.0)
    await admin.ensure_streams()
    await ConfigStore(redis_client, subjects).write("checkpoint", CheckpointPolicy(periodic_interval_s=0), 0, "t")
    store = FileStore(tmp_path / "store")
    service = CheckpointService(CheckpointSettings(gc_interval_s=0, drain_lease_s=2.0), store=store)
    checkpoint = await start_service(service, replace(settings, nats=nats_of("checkpoint")), Wiring)
    m = SecuredMesh(
        subjects, settings, secured, secrets_of_the_mesh, cluster, store, redis_client, admin, auth, checkpoint, service
    )

    async def on_verdict(event: DrainCompleted | DrainFailed) -> None:
        m.verdicts.append(event)

    await admin.subscribe(subjects.pattern("node.drain.completed"), on_verdict, (DrainCompleted,))
    await admin.subscribe(subjects.pattern("node.drain.failed"), on_verdict, (DrainFailed,))
    try:
        yield m
    finally:
        for pod in m.pods.values():
            await pod.endpoint.stop()
        for bus in m.buses:
            await bus.close(0.5)
        await m.checkpoint.stop(grace=1)
        await admin.close(0.5)
        await auth.stop(grace=1)
        await cluster.close()


def bucket_of(subjects: Subjects) -> str:
    """The checkpoint bucket family the callout grants (``GPUWARDEN_AUTH_BUCKET``); the mesh's service itself keeps
    its checkpoints in files."""
    return f"ck-{subjects.root}"


def drains_consumer(mesh: SecuredMesh) -> tuple[str, str]:
    return mesh.subjects.events_stream.name, mesh.subjects.durable("checkpoint", "drains")
