"""The auth callout's settings: where its signing seed and the users' passwords are, which token audience it
accepts, which service accounts are the services' and where agents may run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.contract.base import id_problem
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import env_seconds

DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_AUTH_ISSUER_SEED_FILE": (
        "auth: file holding the account nkey seed the callout signs users with (required; its public key is the "
        "server configuration's auth_callout issuer; never logged)"
    ),
    "GPUWARDEN_AUTH_PASSWORD_DIR": (
        "auth: folder with one file per password user (driver device metrics scaler checkpoint admin, optional "
        "gateway), as for gpuwarden nats-auth; without it only service-account tokens are accepted"
    ),
    "GPUWARDEN_AUTH_TOKEN_AUDIENCE": "auth: the audience a service-account token must be for (default gpuwarden)",
    "GPUWARDEN_AUTH_SERVICE_NAMESPACE": (
        "auth: the namespace of the services' service accounts, gpuwarden-<service> (default gpuwarden)"
    ),
    "GPUWARDEN_AUTH_AGENT_NAMESPACES": (
        "auth: namespaces whose pods' tokens make KV agents, comma separated (default: any namespace)"
    ),
    "GPUWARDEN_AUTH_USER_TTL_S": (
        "auth: seconds a user the callout issues lasts (default 0: as long as its connection; a token is checked "
        "at each connect). The server closes an expired user's connection, which nats-py does not reopen"
    ),
    "GPUWARDEN_AUTH_BUCKET": "auth: the Object Store bucket of checkpoints the agents and the checkpoint service use",
}
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


@dataclass(frozen=True)
class AuthSettings:
    issuer_seed_file: Path | None = None
    password_dir: Path | None = None
    audience: str = "gpuwarden"
    service_namespace: str = "gpuwarden"
    agent_namespaces: tuple[str, ...] = ()
    """Empty: a pod of any namespace may be a KV agent (of itself only)."""
    user_ttl_s: float = 0.0
    """0: a user lasts as long as its connection (a deleted pod's connection ends with its process; every
    reconnect presents the token afresh and is reviewed again)."""
    bucket: str = ""


def load(env: Mapping[str, str] | None = None) -> AuthSettings:
    env = os.environ if env is None else env
    seed = env.get("GPUWARDEN_AUTH_ISSUER_SEED_FILE", "").strip()
    if not seed:
        raise SettingsError("GPUWARDEN_AUTH_ISSUER_SEED_FILE is not set: the callout cannot sign users without it")
    if not Path(seed).is_file():
        raise SettingsError(f"GPUWARDEN_AUTH_ISSUER_SEED_FILE={seed}: no such file")
    folder = env.get("GPUWARDEN_AUTH_PASSWORD_DIR", "").strip()
    if folder and not Path(folder).is_dir():
        raise SettingsError(f"GPUWARDEN_AUTH_PASSWORD_DIR={folder}: no such folder")
    audience = env.get("GPUWARDEN_AUTH_TOKEN_AUDIENCE", "").strip() or "gpuwarden"
    namespace = env.get("GPUWARDEN_AUTH_SERVICE_NAMESPACE", "").strip() or "gpuwarden"
    agents = tuple(n.strip() for n in env.get("GPUWARDEN_AUTH_AGENT_NAMESPACES", "").split(",") if n.strip())
    for name, value in [("GPUWARDEN_AUTH_SERVICE_NAMESPACE", namespace)] + [
        ("GPUWARDEN_AUTH_AGENT_NAMESPACES", n) for n in agents
    ]:
        if problem := id_problem("namespace", value):
            raise SettingsError(f"{name}={value!r}: {problem}")
    bucket = env.get("GPUWARDEN_AUTH_BUCKET", "").strip()
    if bucket and not all(c.isalnum() or c in "-_" for c in bucket):
        raise SettingsError(f"GPUWARDEN_AUTH_BUCKET={bucket!r}: letters, digits, '-' and '_' only")
    return AuthSettings(
        issuer_seed_file=Path(seed),
        password_dir=Path(folder) if folder else None,
        audience=audience,
        service_namespace=namespace,
        agent_namespaces=agents,
        user_ttl_s=env_seconds(env, "GPUWARDEN_AUTH_USER_TTL_S", 0.0, allow_zero=True),
        bucket=bucket,
    )
