"""The connector's settings (``kv_connector_extra_config``, each key falling back to an environment variable) and
the session a request names in its ``kv_transfer_params``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.contract.base import id_problem
from shared.kv.engines.vllm_core.paged import PagedLayout

SESSION_KEY = "gpuwarden_session"
END_KEY = "gpuwarden_end"


DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_NAMESPACE": "vLLM connector: the pod's namespace unless its extra config names one (default default)",
    "GPUWARDEN_DEPLOYMENT": "vLLM connector: the pod's deployment unless its extra config names one (default vllm)",
}
"""Variables only the vLLM connector reads (tools.envdoc); the others it shares with the agents."""


class ConfigError(ValueError):
    """A ``kv_connector_extra_config`` value (or its environment default) that cannot work, named."""


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` of ``--kv-transfer-config``; each key falls back to an environment variable.

    ``store``: where checkpoints go (``GPUWARDEN_CHECKPOINT_STORE``: ``file:///path`` or ``nats://<bucket>``).
    ``nats``: answer the checkpoint service over NATS (drain, periodic and preStop saves; generation claims); the
    connection settings are gpuwarden's own (``GPUWARDEN_NATS_URL`` and friends). Default: on when
    ``GPUWARDEN_NATS_URL`` is set. ``pod``/``node``/``namespace``/``deployment``: the agent's identity
    (``GPUWARDEN_POD_NAME``, ``GPUWARDEN_NODE``, ``GPUWARDEN_NAMESPACE``, ``GPUWARDEN_DEPLOYMENT``).
    ``save_on_finish``: commit a checkpoint of a session each time one of its requests finishes (default: on
    without NATS, where nothing else would save; off with NATS, where the service decides). ``kv_layout``: the
    paged cache's layout when its shape alone is ambiguous (see ``PagedLayout``). ``lookup_timeout_s``: how long
    the scheduler waits for the store or the service when it asks what a checkpoint holds."""

    store: str
    nats: bool = False
    pod: str = "vllm-0"
    node: str = ""
    namespace: str = "default"
    deployment: str = "vllm"
    save_on_finish: bool = True
    kv_layout: str = ""
    lookup_timeout_s: float = 5.0
    announce_s: float = 5.0

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
        env = os.environ if env is None else env
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        store = str(extra.get("store") or env.get("GPUWARDEN_CHECKPOINT_STORE", ""))
        if not store:
            raise ConfigError(
                "kv_connector_extra_config: no checkpoint store: set 'store' (file:///path or nats://<bucket>) "
                "or GPUWARDEN_CHECKPOINT_STORE"
            )
        from shared.kv.stores import parse_store_url

        try:
            kind, _, _ = parse_store_url(store)
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config 'store': {exc}") from None
        nats = _flag(extra, "nats", bool(env.get("GPUWARDEN_NATS_URL")))
        if kind == "nats" and not nats:
            raise ConfigError(f"kv_connector_extra_config: store {store!r} needs 'nats': true")
        layout = str(extra.get("kv_layout", ""))
        named = (*PagedLayout.KINDS, *PagedLayout.PAGE_KINDS)
        if layout and layout not in named:
            raise ConfigError(f"kv_connector_extra_config 'kv_layout'={layout!r}: expected one of {named}")
        try:
            timeout = float(extra.get("lookup_timeout_s", 5.0))
            announce = float(extra.get("announce_s", 5.0))
        except (TypeError, ValueError):
            raise ConfigError("kv_connector_extra_config: lookup_timeout_s and announce_s are numbers") from None
        if timeout <= 0 or announce <= 0:
            raise ConfigError("kv_connector_extra_config: lookup_timeout_s and announce_s must be positive")
        return cls(
            store=store,
            nats=nats,
            pod=str(extra.get("pod") or env.get("GPUWARDEN_POD_NAME") or "vllm-0"),
            node=str(extra.get("node") or env.get("GPUWARDEN_NODE") or os.uname().nodename.split(".")[0]),
            namespace=str(extra.get("namespace") or env.get("GPUWARDEN_NAMESPACE") or "default"),
            deployment=str(extra.get("deployment") or env.get("GPUWARDEN_DEPLOYMENT") or "vllm"),
            save_on_finish=_flag(extra, "save_on_finish", not nats),
            kv_layout=layout,
            lookup_timeout_s=timeout,
            announce_s=announce,
        )


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"kv_connector_extra_config {key!r}={value!r}: expected true or false")


def session_of(kv_transfer_params: Mapping[str, Any] | None) -> tuple[str, bool] | None:
    """``(session id, ends)`` of a request, from its ``kv_transfer_params``; None when it names no session.
    A session id the contract would refuse (``shared.contract.base.id_problem``: letters, digits, '-' and '_', at
    most 128) is refused here with its one-line ``ValueError``, before the agent or the checkpoint service see it."""
    if not kv_transfer_params or SESSION_KEY not in kv_transfer_params:
        return None
    sid = kv_transfer_params[SESSION_KEY]
    problem = id_problem("session", sid)
    if problem:
        raise ValueError(f"{SESSION_KEY}: {problem}")
    return sid, bool(kv_transfer_params.get(END_KEY, False))
