"""NATS JWTs (the jwt v2 claim format nats-server reads): the authorization request the server sends the callout,
the user it is answered with, and the authorization response that carries it.

A JWT is ``base64url(header).base64url(claims).base64url(signature)`` (no padding), the header
``{"typ": "JWT", "alg": "ed25519-nkey"}``, the signature Ed25519 over the first two parts by the key whose public
nkey is the claims' ``iss``. Claims: ``iss``, ``sub``, ``aud``, ``iat``, ``exp``, ``jti``, ``name`` and ``nats``,
which holds the claim's ``type`` (``authorization_request``, ``user``, ``authorization_response``), ``version``
2 and the type's own fields.

Signing uses ``nkeys``; verifying a public nkey (base32 of a prefix byte, 32 key bytes and a CRC-16) uses the
Ed25519 of ``cryptography``. Nothing here logs a claim: a request carries the client's password or token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import nkeys
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

ALGORITHM = "ed25519-nkey"
REQUEST_AUDIENCE = "nats-authorization-request"  # what the server puts in a request's ``aud``
GLOBAL_ACCOUNT = "$G"  # where a user lands on a server without accounts: a user's ``aud`` places it
MAX_TOKEN_BYTES = 1024 * 1024

_PREFIXES = {"account": nkeys.PREFIX_BYTE_ACCOUNT, "server": nkeys.PREFIX_BYTE_SERVER, "user": nkeys.PREFIX_BYTE_USER}


class JwtError(ValueError):
    """A JWT that cannot be read or does not verify; says why, never quoting it."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise JwtError("not base64url") from None


def public_key_bytes(nkey: str, kind: str) -> bytes:
    """The 32 Ed25519 key bytes of a public nkey of ``kind`` (``account``, ``server`` or ``user``)."""
    try:
        raw = base64.b32decode(nkey.encode())
    except (binascii.Error, ValueError):
        raise JwtError(f"not a public {kind} nkey") from None
    if len(raw) != 35 or raw[0] != _PREFIXES[kind]:
        raise JwtError(f"not a public {kind} nkey")
    if int.from_bytes(raw[33:], "little") != nkeys.crc16(bytearray(raw[:33])):
        raise JwtError(f"public {kind} nkey fails its checksum")
    return raw[1:33]


def is_public_key(nkey: object, kind: str) -> bool:
    try:
        return isinstance(nkey, str) and len(public_key_bytes(nkey, kind)) == 32
    except JwtError:
        return False


def new_account_seed() -> bytes:
    """A fresh account seed (``SA...``): the callout's signing key."""
    import os

    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT))


def account_key(seed: bytes) -> nkeys.KeyPair:
    """The account key pair of ``seed``; ``JwtError`` if it is not an account seed (never quoting it)."""
    try:
        pair = nkeys.from_seed(bytearray(seed.strip()))
        public = pair.public_key.decode()
    except Exception:
        raise JwtError("not an nkey seed") from None
    if not public.startswith("A"):
        raise JwtError("the seed is not an account's (its public key must start with A)")
    return pair


def encode(claims: Mapping[str, Any], signer: nkeys.KeyPair, now: int) -> str:
    """Sign ``claims`` (``sub``, ``aud``, ``exp``, ``name`` and ``nats`` as given) as ``signer``: ``iss`` and
    ``iat`` are set here, and ``jti`` (the SHA-512/256 of the claims without it, as the jwt library does)."""
    body = {k: v for k, v in claims.items() if v not in (None, "")}
    body["iss"] = signer.public_key.decode()
    body["iat"] = now
    body.pop("jti", None)
    body["jti"] = base64.b32encode(hashlib.new("sha512_256", json.dumps(body).encode()).digest()).decode().rstrip("=")
    header = _b64(json.dumps({"typ": "JWT", "alg": ALGORITHM}).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signature = signer.sign(f"{header}.{payload}".encode())
    return f"{header}.{payload}.{_b64(signature)}"


def decode(token: str, issuer_kind: str) -> dict[str, Any]:
    """The claims of ``token``, once its signature verifies against its own ``iss``, which must be a public nkey
    of ``issuer_kind``. Times and audiences are the caller's to check."""
    if len(token) > MAX_TOKEN_BYTES:
        raise JwtError("too large")
    parts = token.split(".")
    if len(parts) != 3:
        raise JwtError("not a JWT (three parts)")
    try:
        header = json.loads(_unb64(parts[0]))
        claims = json.loads(_unb64(parts[1]))
    except (ValueError, UnicodeDecodeError):
        raise JwtError("header or claims are not JSON") from None
    if not isinstance(header, dict) or str(header.get("alg", "")).lower() != ALGORITHM:
        raise JwtError("not signed with an nkey (alg)")
    if not isinstance(claims, dict) or not isinstance(claims.get("nats"), dict):
        raise JwtError("no nats claims")
    key = public_key_bytes(str(claims.get("iss", "")), issuer_kind)
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(_unb64(parts[2]), f"{parts[0]}.{parts[1]}".encode())
    except InvalidSignature:
        raise JwtError("signature does not verify") from None
    return claims


@dataclass(frozen=True, slots=True)
class AuthorizationRequest:
    """What nats-server asks about one connecting client (the ``authorization_request`` claims)."""

    server_id: str
    server_name: str
    user_nkey: str
    """The public key the server made for this connection: the user in the answer must be it."""
    user: str
    password: str
    token: str
    client_name: str
    client_host: str
    expires_at: int

    def __repr__(self) -> str:  # the password and the token never show
        return f"AuthorizationRequest(server={self.server_name!r}, user={self.user!r}, client={self.client_name!r})"


def read_request(token: str, issuer: str, now: float) -> AuthorizationRequest:
    """An authorization request: signed by a server, addressed to ``issuer`` (the callout's account), meant for
    the callout (``aud``), not expired, naming a user key to answer for. ``JwtError`` otherwise."""
    claims = decode(token, "server")
    nats = claims["nats"]
    if nats.get("type") != "authorization_request":
        raise JwtError(f"not an authorization request ({nats.get('type')!r})")
    if claims.get("sub") != issuer:
        raise JwtError("addressed to another issuer")
    if claims.get("aud") != REQUEST_AUDIENCE:
        raise JwtError("not meant for an auth callout (aud)")
    expires = int(claims.get("exp") or 0)
    if expires and now > expires:
        raise JwtError("expired")
    user_nkey = nats.get("user_nkey")
    if not is_public_key(user_nkey, "user"):
        raise JwtError("no user key to answer for")
    server = nats.get("server_id") or {}
    connect = nats.get("connect_opts") or {}
    client = nats.get("client_info") or {}
    if not is_public_key(server.get("id"), "server"):
        raise JwtError("no server id")
    return AuthorizationRequest(
        server_id=str(server["id"]),
        server_name=str(server.get("name") or ""),
        user_nkey=str(user_nkey),
        user=str(connect.get("user") or ""),
        password=str(connect.get("pass") or ""),
        token=str(connect.get("auth_token") or ""),
        client_name=str(connect.get("name") or client.get("name") or ""),
        client_host=str(client.get("host") or ""),
        expires_at=expires,
    )


def user_claims(
    user_nkey: str,
    name: str,
    permissions: Mapping[str, Any],
    expires_at: int | None,
    account: str = GLOBAL_ACCOUNT,
) -> dict[str, Any]:
    """The claims of a user for ``user_nkey`` named ``name`` with nats-server ``permissions`` (``publish``,
    ``subscribe``, ``allow_responses``, as ``shared.contract.permissions`` builds them), placed in ``account``
    (``aud``) and valid until ``expires_at``: the server disconnects it then, and the client connects anew."""
    nats: dict[str, Any] = {"subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}
    for ours, theirs in (("publish", "pub"), ("subscribe", "sub")):
        given = permissions.get(ours) or {}
        part = {key: list(given[key]) for key in ("allow", "deny") if given.get(key)}
        if part:
            nats[theirs] = part
    if permissions.get("allow_responses"):
        nats["resp"] = {"max": 1, "ttl": 0}  # one reply per request received; the server's default expiry
    return {"sub": user_nkey, "aud": account, "name": name, "exp": expires_at, "nats": nats}


def response_claims(user_nkey: str, server_id: str, user_jwt: str = "", error: str = "") -> dict[str, Any]:
    """An authorization response for ``user_nkey`` to the server ``server_id``: the signed user, or why none."""
    nats: dict[str, Any] = {"type": "authorization_response", "version": 2}
    if user_jwt:
        nats["jwt"] = user_jwt
    else:
        nats["error"] = error or "not authorized"
    return {"sub": user_nkey, "aud": server_id, "nats": nats}
