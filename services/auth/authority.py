"""Who a connecting client is, decided from its credentials alone (never from anything else it says).

- A password user (``<root>-<service>``, ``<root>-admin``, ``<root>-gateway``): the password must be that user's,
  compared in constant time (an unknown user costs the same comparison). A node-scoped service's node is the one
  its connection name gives (``device/node-3``, what the runner names it): the node's instances share one
  password, so they are one party, and the node only narrows what the instance can reach.
- A Kubernetes service-account token: the cluster reviews it (signature, expiry, audience, and that the pod it is
  bound to still exists). The service account ``<service namespace>/gpuwarden-<service>`` is that service (a
  node-scoped one's node: the one the cluster names for its pod, else its connection name's, as for a password);
  any other token bound to a pod is that pod's KV agent, in the namespace and of the pod the cluster names, and
  nothing else. A KV agent never authenticates with a password.

The verdict says who, until when, or why not; the service turns it into a signed user.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from services.auth.config import AuthSettings
from services.auth.natsjwt import AuthorizationRequest
from services.auth.ports import TokenReviewer
from shared.contract.base import id_problem
from shared.contract.permissions import ADMIN, AGENT, GATEWAY, NODE_SCOPED, SERVICES, Identity, user_name
from shared.contract.subjects import Subjects
from shared.ports.cluster import ClusterError

PASSWORD_ROLES: tuple[str, ...] = (*SERVICES, ADMIN, GATEWAY)
_NO_SUCH_USER = "x" * 32  # compared against when the user is unknown, so that the time says nothing


@dataclass(frozen=True, slots=True)
class Verdict:
    identity: Identity | None
    expires_at: int = 0
    reason: str = ""
    """Why the client was refused; empty when it was not."""
    via: str = ""
    """``password`` or ``token``."""


class Authority:
    """Decides each authorization request; holds the passwords (``role -> password``) and asks ``reviewer``
    about tokens."""

    def __init__(
        self,
        settings: AuthSettings,
        subjects: Subjects,
        passwords: Mapping[str, str],
        reviewer: TokenReviewer | None,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.subjects = subjects
        self._passwords = {user_name(subjects, role): pw for role, pw in passwords.items() if role in PASSWORD_ROLES}
        self._roles = {user_name(subjects, role): role for role in PASSWORD_ROLES}
        self.reviewer = reviewer
        self.clock = clock

    async def decide(self, request: AuthorizationRequest) -> Verdict:
        if request.user:
            return self._by_password(request)
        if request.token:
            return await self._by_token(request.token, request.client_name)
        return Verdict(None, reason="no credentials: a password or a service-account token is required")

    def _by_password(self, request: AuthorizationRequest) -> Verdict:
        stored = self._passwords.get(request.user)
        matches = hmac.compare_digest((stored or _NO_SUCH_USER).encode(), request.password.encode())
        if stored is None or not matches:
            return Verdict(None, reason=f"user {request.user!r}: unknown, or not this password", via="password")
        role = self._roles[request.user]
        node = _named_node(request.client_name) if role in NODE_SCOPED else ""
        return Verdict(Identity(role, node=node), self._expiry(), via="password")

    async def _by_token(self, token: str, client_name: str) -> Verdict:
        if self.reviewer is None:
            return Verdict(None, reason="service-account tokens are not accepted here (no cluster)", via="token")
        audience = self.settings.audience
        try:
            review = await self.reviewer.review_token(token, (audience,))
        except ClusterError as exc:
            return Verdict(None, reason=f"the token could not be reviewed now: {exc}", via="token")
        if not review.authenticated:
            return Verdict(
                None, reason=f"token refused by the cluster: {review.error or 'not authenticated'}", via="token"
            )
        if review.audiences and audience not in review.audiences:
            return Verdict(None, reason=f"token is not for the audience {audience!r}", via="token")
        namespace, account = review.service_account
        if not namespace:
            return Verdict(None, reason="the token is no service account's", via="token")
        expires = self._expiry()
        if namespace == self.settings.service_namespace:
            for service in SERVICES:
                if account == f"gpuwarden-{service}":
                    proven = review.node if not id_problem("node", review.node) else ""
                    node = (proven or _named_node(client_name)) if service in NODE_SCOPED else ""
                    return Verdict(Identity(service, node=node), expires, via="token")
        pod = review.pod
        if not pod:
            return Verdict(
                None, reason=f"service account {namespace}/{account} is no service's and no pod's", via="token"
            )
        if self.settings.agent_namespaces and namespace not in self.settings.agent_namespaces:
            return Verdict(None, reason=f"pods of namespace {namespace} may not be KV agents here", via="token")
        if id_problem("pod", pod) or id_problem("namespace", namespace):
            return Verdict(None, reason="the cluster named a pod that is no valid name", via="token")
        return Verdict(Identity(AGENT, pod=pod, namespace=namespace), expires, via="token")

    def _expiry(self) -> int:
        """When the user ends (0: with its connection). Not with the token: nats-py does not reopen a connection
        the server closes for an expired user, and a token is reviewed again at every reconnect anyway."""
        ttl = self.settings.user_ttl_s
        return int(self.clock() + ttl) if ttl > 0 else 0


def _named_node(client_name: str) -> str:
    """The node in a connection name ``<service>/<node>`` (as the runner names a node-scoped service's); ''."""
    _, _, named = client_name.partition("/")
    return named if named and not id_problem("node", named) else ""
