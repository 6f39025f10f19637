"""The auth callout's settings: where its signing seed and the users' passwords are, which token audience it
accepts, which service accounts are the services' and where agents may run. Each is declared once: variable,
default, documentation and parsing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.contract.base import id_problem
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import Parse, any_text, documented, existing_file, seconds, setting, settings_from_env


def _folder(name: str, raw: str) -> Path:
    if not Path(raw).is_dir():
        raise SettingsError(f"{name}={raw}: no such folder")
    return Path(raw)


def _namespace(name: str, raw: str) -> str:
    if problem := id_problem("namespace", raw):
        raise SettingsError(f"{name}={raw!r}: {problem}")
    return raw


def _namespaces(name: str, raw: str) -> tuple[str, ...]:
    return tuple(_namespace(name, n.strip()) for n in raw.split(",") if n.strip())


def _bucket(name: str, raw: str) -> str:
    if not all(c.isalnum() or c in "-_" for c in raw):
        raise SettingsError(f"{name}={raw!r}: letters, digits, '-' and '_' only")
    return raw


@dataclass(frozen=True)
class AuthSettings:
    issuer_seed_file: Path | None = setting(
        "GPUWARDEN_AUTH_ISSUER_SEED_FILE",
        None,
        "auth: file holding the account nkey seed the callout signs users with (required; its public key is the "
        "server configuration's auth_callout issuer; never logged)",
        parse=existing_file(),
        required="the callout cannot sign users without it",
    )
    password_dir: Path | None = setting(
        "GPUWARDEN_AUTH_PASSWORD_DIR",
        None,
        "auth: folder with one file per password user (driver device metrics scaler checkpoint admin, optional "
        "gateway), as for gpuwarden nats-auth; without it only service-account tokens are accepted",
        parse=Parse(_folder),
    )
    audience: str = setting(
        "GPUWARDEN_AUTH_TOKEN_AUDIENCE",
        "gpuwarden",
        "auth: the audience a service-account token must be for",
        parse=any_text(),
    )
    service_namespace: str = setting(
        "GPUWARDEN_AUTH_SERVICE_NAMESPACE",
        "gpuwarden",
        "auth: the namespace of the services' service accounts, gpuwarden-<service>",
        parse=Parse(_namespace),
    )
    agent_namespaces: tuple[str, ...] = setting(
        "GPUWARDEN_AUTH_AGENT_NAMESPACES",
        (),
        "auth: namespaces whose pods' tokens make KV agents, comma separated",
        parse=Parse(_namespaces),
        shown="any namespace",
    )
    """Empty: a pod of any namespace may be a KV agent (of itself only)."""
    user_ttl_s: float = setting(
        "GPUWARDEN_AUTH_USER_TTL_S",
        0.0,
        "auth: seconds a user the callout issues lasts; 0: as long as its connection (a token is checked at each "
        "connect). The server closes an expired user's connection, which nats-py does not reopen",
        parse=seconds(allow_zero=True),
    )
    """0: a user lasts as long as its connection (a deleted pod's connection ends with its process; every
    reconnect presents the token afresh and is reviewed again)."""
    bucket: str = setting(
        "GPUWARDEN_AUTH_BUCKET",
        "",
        "auth: the Object Store bucket of checkpoints the agents and the checkpoint service use",
        parse=Parse(_bucket),
    )


DOCUMENTED = documented(AuthSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def load(env: Mapping[str, str] | None = None) -> AuthSettings:
    return settings_from_env(AuthSettings, env)
