from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import env_seconds

DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_DRIVER_RECONCILE_S": "driver: seconds between reconciliations (default 10)",
    "GPUWARDEN_DRIVER_COORDINATE": "driver: take part in electing the cluster-wide upgrade coordinator (default true)",
    "GPUWARDEN_DRIVER_LEASE_TTL_S": "driver: coordinator leader lease TTL (default 15)",
    "GPUWARDEN_DRIVER_AGENT_TIMEOUT_S": (
        "driver: seconds the coordinator waits for a node's driver agent to answer one command (default 5; "
        "the lease TTL must be at least twice it); the whole install is bounded by the `driver` document's "
        "`install_timeout_s`"
    ),
}
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


@dataclass(frozen=True)
class DriverSettings:
    reconcile_s: float = 10.0
    coordinate: bool = True
    """Take part in the election of the cluster-wide upgrade coordinator (every replica may; one leads)."""
    lease_ttl_s: float = 15.0
    agent_timeout_s: float = 5.0
    """How long the coordinator waits for a node's driver agent to answer one command (a longer install answers
    ``running`` and is asked again next pass; the policy's ``install_timeout_s`` bounds the whole install)."""


def load(env: Mapping[str, str] | None = None) -> DriverSettings:
    env = os.environ if env is None else env
    coordinate = env.get("GPUWARDEN_DRIVER_COORDINATE", "true").lower()
    if coordinate not in ("true", "false", "1", "0"):
        raise SettingsError(f"GPUWARDEN_DRIVER_COORDINATE={coordinate!r}: expected true or false")
    settings = DriverSettings(
        reconcile_s=env_seconds(env, "GPUWARDEN_DRIVER_RECONCILE_S", 10.0),
        coordinate=coordinate in ("true", "1"),
        lease_ttl_s=env_seconds(env, "GPUWARDEN_DRIVER_LEASE_TTL_S", 15.0),
        agent_timeout_s=env_seconds(env, "GPUWARDEN_DRIVER_AGENT_TIMEOUT_S", 5.0),
    )
    if settings.lease_ttl_s < 2 * settings.agent_timeout_s:
        raise SettingsError(
            f"GPUWARDEN_DRIVER_LEASE_TTL_S={settings.lease_ttl_s:g} must be at least twice "
            f"GPUWARDEN_DRIVER_AGENT_TIMEOUT_S={settings.agent_timeout_s:g}: the coordinator renews its lease between "
            "commands to the nodes' agents, and two may come between renewals"
        )
    return settings
