"""The router's settings: where its ext_proc gRPC server listens, which pool it picks in, and how it reads a request.
Each is declared once (variable, default, documentation, parsing); docs/configuration.md lists them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared.contract.base import id_problem
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import (
    HostPort,
    count,
    documented,
    host_port,
    matching,
    number,
    on_off,
    seconds,
    setting,
    settings_from_env,
)

HEADER_NAME = r"^[a-z0-9!#$%&'*+.^_`|~-]+$"


@dataclass(frozen=True)
class RouterSettings:
    listen: HostPort = setting(
        "GPUWARDEN_ROUTER_ADDR",
        HostPort("0.0.0.0", 9002),
        "router: gRPC listen address of the endpoint picker (Envoy ext_proc and grpc.health.v1); port 0 takes a "
        "free port",
        parse=host_port("0.0.0.0:9002"),
    )
    share_port: bool = setting(
        "GPUWARDEN_ROUTER_SHARE_PORT",
        False,
        "router: listen with SO_REUSEPORT, so that a port its launcher holds reserved (gpuwarden up keeps the "
        "router's port bound for the whole run: a restarted router finds it free) can be bound; off: a port any "
        "other socket holds is an error",
        parse=on_off(),
    )
    pool: str = setting(
        "GPUWARDEN_ROUTER_POOL",
        "llm/llama",
        "router: the deployment whose pods it picks among, as namespace/deployment (the InferencePool's pods)",
        parse=matching(r"^[^/]+/[^/]+$", "expected namespace/deployment"),
    )
    target_port: int = setting(
        "GPUWARDEN_ROUTER_TARGET_PORT",
        8000,
        "router: the model servers' port in the endpoints it answers (the InferencePool's targetPorts)",
        parse=count(minimum=1, maximum=65535),
    )
    session_header: str = setting(
        "GPUWARDEN_ROUTER_SESSION_HEADER",
        "x-session-id",
        "router: the request header naming the session (else the OpenAI body's user field)",
        parse=matching(HEADER_NAME, "expected a lower-case HTTP header name"),
    )
    fallbacks: int = setting(
        "GPUWARDEN_ROUTER_FALLBACKS",
        2,
        "router: endpoints answered after the first, in order, for the gateway's retries",
        parse=count(minimum=0, maximum=16),
    )
    shed_at: float = setting(
        "GPUWARDEN_ROUTER_SHED_AT",
        0.99,
        "router: KV-cache utilisation at or above which every pod counts as full: a request with no holder is "
        "shed (429); above 1 never sheds",
        parse=number(minimum=0.0),
    )
    load_stale_s: float = setting(
        "GPUWARDEN_ROUTER_LOAD_STALE_S",
        15.0,
        "router: seconds after which a pod's kv.pod.load report no longer counts (its load is unknown)",
        parse=seconds(minimum=1, maximum=600),
    )
    max_body_bytes: int = setting(
        "GPUWARDEN_ROUTER_MAX_BODY_BYTES",
        1_048_576,
        "router: request body bytes read for the session (the user field); a larger body is routed without it",
        parse=count(minimum=0, maximum=64 * 1_048_576),
    )
    max_sessions: int = setting(
        "GPUWARDEN_ROUTER_MAX_SESSIONS",
        1_000_000,
        "router: sessions whose location it keeps in memory; past it the least recently changed are forgotten",
        parse=count(minimum=1, maximum=100_000_000),
    )
    pods_resync_s: float = setting(
        "GPUWARDEN_ROUTER_PODS_RESYNC_S",
        30.0,
        "router: seconds between two listings of the pool's pods (and readings of their nodes) when the cluster's "
        "watch says nothing",
        parse=seconds(minimum=0.1, maximum=3600),
    )
    handover_wait_s: float = setting(
        "GPUWARDEN_ROUTER_HANDOVER_WAIT_S",
        10.0,
        "router: seconds a request of a session being moved (handed to a pod, its new location not heard yet) "
        "waits for the new holder instead of going to a pod that does not hold it; past it 503 (the client "
        "retries); 0 never waits",
        parse=seconds(allow_zero=True, maximum=300),
    )
    prefetch_s: float = setting(
        "GPUWARDEN_ROUTER_PREFETCH_S",
        30.0,
        "router: when a pod stops serving (drained, scaled in, replaced), the sessions it held that had a request "
        "within this many seconds are restored on their next pod ahead of their next request "
        "(kv.session.prefetch.command); 0 never prefetches",
        parse=seconds(allow_zero=True, maximum=86400),
    )
    deletion_cost_s: float = setting(
        "GPUWARDEN_ROUTER_DELETION_COST_S",
        10.0,
        "router: seconds between two writes of each pod's controller.kubernetes.io/pod-deletion-cost (its sessions "
        "plus their tokens / 4096, rounded to 3 significant bits; only when changed, at most 10 pods a second): "
        "scale-in removes the pods cheapest to evacuate first; 0 writes none",
        parse=seconds(allow_zero=True, maximum=3600),
    )

    @property
    def namespace(self) -> str:
        return self.pool.partition("/")[0]

    @property
    def deployment(self) -> str:
        return self.pool.partition("/")[2]


DOCUMENTED = documented(RouterSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def load(env: Mapping[str, str] | None = None) -> RouterSettings:
    """Read the router's variables, or raise ``SettingsError`` naming the one that is wrong."""
    settings = settings_from_env(RouterSettings, env)
    for kind, value in (("namespace", settings.namespace), ("deployment", settings.deployment)):
        problem = id_problem(kind, value)
        if problem:
            raise SettingsError(f"GPUWARDEN_ROUTER_POOL={settings.pool!r}: {problem}")
    return settings
