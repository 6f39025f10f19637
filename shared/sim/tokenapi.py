"""The simulated cluster's service-account token API: TokenRequest (the token a kubelet projects into a pod, or one
for a service account alone) and TokenReview (what the auth service asks of a token), over the simulated cluster's
pods and a signing key kept in Redis beside it (``<root>:sim:cluster:token-key``, made once per cluster).

The tokens themselves (their claims, signing and checks) are ``shared.sim.tokens``; ``SimCluster`` answers the
cluster port's ``review_token`` from here. SIMULATED.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.contract.subjects import Subjects
from shared.ports.cluster import NODE_NAME_EXTRA, POD_NAME_EXTRA, POD_UID_EXTRA, ClusterError, TokenReview
from shared.sim.clusterstate import ClusterState, object_key
from shared.sim.tokens import TokenClaims, TokenInvalid, service_account_uid
from shared.sim.tokens import sign as sign_token
from shared.sim.tokens import verify as verify_token

_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


class SimTokenApi:
    """Issues and reviews the simulated cluster's service-account tokens. ``read`` gives the cluster's newest state
    (a bound token is checked against its pod), ``clock`` the time in seconds since the epoch."""

    def __init__(
        self,
        client: aioredis.Redis,
        subjects: Subjects,
        clock: Callable[[], float],
        read: Callable[[], Awaitable[ClusterState]],
    ) -> None:
        self._client = client
        self._key_name = subjects.redis_key("sim", "cluster", "token-key")
        self._clock = clock
        self._read = read

    async def issue(
        self,
        namespace: str,
        pod: str = "",
        audience: str = "gpuwarden",
        ttl_s: float = 3600.0,
        service_account: str = "default",
    ) -> str:
        """A service-account token as a kubelet projects it into a pod (``pod`` given: bound to it, naming its UID
        and node) or as the TokenRequest API gives one to a service account alone. (Simulation only: the stand-in
        for the kubelet's projected volume.) ``ClusterError`` for a pod that is not in the cluster."""
        bound = ""
        uid = ""
        node = ""
        if pod:
            found = (await self._read()).pods.get(object_key(namespace, pod))
            if found is None:
                raise ClusterError(f"pod {object_key(namespace, pod)} is not in the simulated cluster")
            bound, uid, node = found.name, found.uid, found.node
        now = int(self._clock())
        claims = TokenClaims(
            namespace=namespace,
            service_account=service_account,
            audiences=(audience,),
            expires_at=now + int(ttl_s),
            issued_at=now,
            pod=bound,
            pod_uid=uid,
            node=node,
        )
        return sign_token(claims, await self._key())

    async def review(self, token: str, audiences: tuple[str, ...]) -> TokenReview:
        """The TokenReview API: the token's signature (the cluster's own key), expiry and audience, and for a
        bound token that its pod is still there, the same pod (UID), and running (Running, or Terminating while
        its preStop hook saves); whose it is, as Kubernetes says it."""
        try:
            claims = verify_token(token, await self._key(), self._clock(), audiences)
        except TokenInvalid as exc:
            return TokenReview(authenticated=False, error=f"invalid bearer token, {exc}")
        extra: dict[str, tuple[str, ...]] = {}
        if claims.pod:
            found = (await self._read()).pods.get(object_key(claims.namespace, claims.pod))
            if found is None or found.uid != claims.pod_uid:
                return TokenReview(authenticated=False, error="invalid bearer token, the pod it is bound to is gone")
            if found.phase not in ("Running", "Terminating"):
                return TokenReview(authenticated=False, error=f"invalid bearer token, its pod is {found.phase}")
            extra = {POD_NAME_EXTRA: (claims.pod,), POD_UID_EXTRA: (claims.pod_uid,)}
            if claims.node:
                extra[NODE_NAME_EXTRA] = (claims.node,)
        return TokenReview(
            authenticated=True,
            username=claims.username,
            uid=service_account_uid(claims.namespace, claims.service_account),
            groups=("system:serviceaccounts", f"system:serviceaccounts:{claims.namespace}", "system:authenticated"),
            extra=extra,
            audiences=tuple(a for a in claims.audiences if not audiences or a in audiences),
        )

    async def _key(self) -> bytes:
        """The key the simulated cluster signs its tokens with, made once per cluster (kept in Redis with it)."""
        try:
            await self._client.set(self._key_name, secrets.token_bytes(32), nx=True)
            key = await self._client.get(self._key_name)
        except _REDIS_DOWN as exc:
            raise ClusterError(f"simulated cluster: Redis unreachable: {exc}") from exc
        if not isinstance(key, bytes) or len(key) != 32:
            raise ClusterError(f"the simulated cluster's token key at {self._key_name} is unreadable")
        return key
