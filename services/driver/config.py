"""The driver service's settings, each declared once: variable, default, documentation and parsing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import Parse, documented, seconds, setting, settings_from_env


def _true_false(name: str, raw: str) -> bool:
    value = raw.lower()
    if value not in ("true", "false", "1", "0"):
        raise SettingsError(f"{name}={value!r}: expected true or false")
    return value in ("true", "1")


TRUE_FALSE: Parse[bool] = Parse(_true_false, lambda value: "true" if value else "false")


@dataclass(frozen=True)
class DriverSettings:
    reconcile_s: float = setting(
        "GPUWARDEN_DRIVER_RECONCILE_S", 10.0, "driver: seconds between reconciliations", parse=seconds()
    )
    resync_s: float = setting(
        "GPUWARDEN_DRIVER_RESYNC_S",
        300.0,
        "driver: seconds between the upgrade coordinator's full passes; between them a pass reads only the nodes "
        "the cluster watch or a drain verdict reported changed and those with an upgrade in flight, and a full pass "
        "finds what no watch reports (a driver installed on a node by hand, a change the watch lost)",
        parse=seconds(),
    )
    """Seconds between full passes of the upgrade coordinator (every node read); between them a pass costs what
    changed, not the fleet's size (``services.driver.coordinator``)."""
    coordinate: bool = setting(
        "GPUWARDEN_DRIVER_COORDINATE",
        True,
        "driver: take part in electing the cluster-wide upgrade coordinator",
        parse=TRUE_FALSE,
    )
    """Take part in the election of the cluster-wide upgrade coordinator (every replica may; one leads)."""
    lease_ttl_s: float = setting(
        "GPUWARDEN_DRIVER_LEASE_TTL_S", 15.0, "driver: coordinator leader lease TTL", parse=seconds()
    )
    agent_timeout_s: float = setting(
        "GPUWARDEN_DRIVER_AGENT_TIMEOUT_S",
        5.0,
        "driver: seconds the coordinator waits for a node's driver agent to answer one command; the lease TTL must "
        "be at least twice it, and the whole install is bounded by the `driver` document's `install_timeout_s`",
        parse=seconds(),
    )
    """How long the coordinator waits for a node's driver agent to answer one command (a longer install answers
    ``running`` and is asked again next pass; the policy's ``install_timeout_s`` bounds the whole install)."""


DOCUMENTED = documented(DriverSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def load(env: Mapping[str, str] | None = None) -> DriverSettings:
    settings = settings_from_env(DriverSettings, env)
    if settings.lease_ttl_s < 2 * settings.agent_timeout_s:
        raise SettingsError(
            f"GPUWARDEN_DRIVER_LEASE_TTL_S={settings.lease_ttl_s:g} must be at least twice "
            f"GPUWARDEN_DRIVER_AGENT_TIMEOUT_S={settings.agent_timeout_s:g}: the coordinator renews its lease between "
            "commands to the nodes' agents, and two may come between renewals"
        )
    return settings
