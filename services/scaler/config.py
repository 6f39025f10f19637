"""The scaler's settings: where the KEDA-facing gRPC server listens, its TLS files, and how often it refreshes.

| variable | meaning |
|---|---|
| ``GPUWARDEN_SCALER_ADDR`` | host:port of the gRPC server (default 0.0.0.0:9090; port 0 takes a free port) |
| ``GPUWARDEN_SCALER_TLS_CERT`` | PEM server certificate: serve TLS (with ``_KEY``) |
| ``GPUWARDEN_SCALER_TLS_KEY`` | PEM private key of that certificate |
| ``GPUWARDEN_SCALER_TLS_CA`` | PEM CA bundle: require client certificates signed by it (mTLS) |
| ``GPUWARDEN_SCALER_REFRESH_S`` | seconds between queue depth reads from JetStream (default 1) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import env_seconds, parse_host_port

DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_SCALER_ADDR": (
        "scaler: gRPC listen address of the KEDA external scaler (default 0.0.0.0:9090; port 0 takes a free port)"
    ),
    "GPUWARDEN_SCALER_TLS_CERT": "scaler: serve TLS with this PEM certificate and key",
    "GPUWARDEN_SCALER_TLS_KEY": "scaler: the PEM key of GPUWARDEN_SCALER_TLS_CERT",
    "GPUWARDEN_SCALER_TLS_CA": "scaler: require client certificates signed by this CA (mTLS)",
    "GPUWARDEN_SCALER_REFRESH_S": (
        "scaler: seconds between background refreshes of queue depth and utilisation (default 1)"
    ),
}
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


@dataclass(frozen=True)
class ScalerTls:
    """TLS of the gRPC server: off without a certificate; mutual when a client CA is given."""

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None


@dataclass(frozen=True)
class ScalerSettings:
    host: str = "0.0.0.0"
    port: int = 9090
    tls: ScalerTls = ScalerTls()
    refresh_s: float = 1.0


def _pem(env: Mapping[str, str], name: str) -> Path | None:
    value = env.get(name)
    if not value:
        return None
    path = Path(value)
    if not path.is_file():
        raise SettingsError(f"{name}={value}: no such file (expected a PEM file)")
    return path


def load(env: Mapping[str, str] | None = None) -> ScalerSettings:
    """Read the scaler's variables, or raise ``SettingsError`` naming the one that is wrong."""
    env = os.environ if env is None else env
    host, port = parse_host_port("GPUWARDEN_SCALER_ADDR", env.get("GPUWARDEN_SCALER_ADDR", "0.0.0.0:9090"))
    tls = ScalerTls(
        cert=_pem(env, "GPUWARDEN_SCALER_TLS_CERT"),
        key=_pem(env, "GPUWARDEN_SCALER_TLS_KEY"),
        client_ca=_pem(env, "GPUWARDEN_SCALER_TLS_CA"),
    )
    if (tls.cert is None) != (tls.key is None):
        raise SettingsError("GPUWARDEN_SCALER_TLS_CERT and GPUWARDEN_SCALER_TLS_KEY go together: set both or neither")
    if tls.client_ca is not None and tls.cert is None:
        raise SettingsError("GPUWARDEN_SCALER_TLS_CA (mTLS) needs GPUWARDEN_SCALER_TLS_CERT and _KEY as well")
    refresh_s = env_seconds(env, "GPUWARDEN_SCALER_REFRESH_S", 1.0, minimum=0.05, maximum=60)
    return ScalerSettings(host=host, port=port, tls=tls, refresh_s=refresh_s)
