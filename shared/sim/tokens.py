"""SIMULATED service-account tokens: what a kubelet mounts into a pod (a projected, bound token) and what the API
server's TokenReview says of one, for the simulated cluster (``shared.sim.cluster``).

A token has the shape of Kubernetes' own: a JWT whose ``sub`` is ``system:serviceaccount:<ns>:<name>``, with
``aud``, ``iat``, ``nbf``, ``exp`` and the ``kubernetes.io`` claim naming the namespace, the service account and,
for a bound token, the pod (name and UID) and its node. It is signed HS256 with the simulated cluster's own key
(Kubernetes signs with the API server's private key; the simulation is both issuer and reviewer, as the API server
is). Pure: the key and the clock are passed in; nothing here logs a token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import uuid
from dataclasses import dataclass
from typing import Any

ISSUER = "https://kubernetes.default.svc.cluster.local (SIMULATED)"
_HEADER = {"alg": "HS256", "typ": "JWT", "kid": "gpuwarden-sim"}


class TokenInvalid(ValueError):
    """Why a token is not one the simulated cluster signed, or no longer holds."""


@dataclass(frozen=True, slots=True)
class TokenClaims:
    namespace: str
    service_account: str
    audiences: tuple[str, ...]
    expires_at: int
    issued_at: int
    pod: str = ""
    pod_uid: str = ""
    node: str = ""

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def service_account_uid(namespace: str, name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpuwarden-sim:serviceaccount:{namespace}/{name}"))


def node_uid(name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpuwarden-sim:node:{name}"))


def sign(claims: TokenClaims, key: bytes) -> str:
    body: dict[str, Any] = {
        "iss": ISSUER,
        "sub": claims.username,
        "aud": list(claims.audiences),
        "iat": claims.issued_at,
        "nbf": claims.issued_at,
        "exp": claims.expires_at,
        "jti": str(uuid.uuid4()),
        "kubernetes.io": {
            "namespace": claims.namespace,
            "serviceaccount": {
                "name": claims.service_account,
                "uid": service_account_uid(claims.namespace, claims.service_account),
            },
        },
    }
    if claims.pod:
        body["kubernetes.io"]["pod"] = {"name": claims.pod, "uid": claims.pod_uid}
    if claims.node:
        body["kubernetes.io"]["node"] = {"name": claims.node, "uid": node_uid(claims.node)}
    signing_input = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(body).encode())}"
    signature = hmac.new(key, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(signature)}"


def verify(token: str, key: bytes, now: float, audiences: tuple[str, ...]) -> TokenClaims:
    """The claims of a token this key signed, unexpired at ``now`` and meant for one of ``audiences``; else
    ``TokenInvalid`` saying why (never quoting the token)."""
    parts = token.split(".")
    if len(parts) != 3:
        raise TokenInvalid("not a JWT")
    try:
        header = json.loads(_unb64(parts[0]))
        signature = _unb64(parts[2])
    except (ValueError, UnicodeDecodeError):
        raise TokenInvalid("not a JWT") from None
    if not isinstance(header, dict) or header.get("alg") != "HS256":
        raise TokenInvalid("not signed by the simulated cluster (algorithm)")
    expected = hmac.new(key, f"{parts[0]}.{parts[1]}".encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(expected, signature):
        raise TokenInvalid("signature does not verify")
    try:
        body = json.loads(_unb64(parts[1]))
        k8s = body["kubernetes.io"]
        namespace, account = str(k8s["namespace"]), str(k8s["serviceaccount"]["name"])
        pod = k8s.get("pod") or {}
        node = k8s.get("node") or {}
        aud = body.get("aud") or []
        claims = TokenClaims(
            namespace=namespace,
            service_account=account,
            audiences=tuple(str(a) for a in (aud if isinstance(aud, list) else [aud])),
            expires_at=int(body["exp"]),
            issued_at=int(body.get("nbf") or body.get("iat") or 0),
            pod=str(pod.get("name") or ""),
            pod_uid=str(pod.get("uid") or ""),
            node=str(node.get("name") or ""),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        raise TokenInvalid("claims unreadable") from None
    if now >= claims.expires_at:
        raise TokenInvalid("token has expired")
    if now < claims.issued_at - 60:
        raise TokenInvalid("token is not valid yet")
    if audiences and not set(audiences) & set(claims.audiences):
        raise TokenInvalid("token audiences is invalid for the target audiences")
    return claims
