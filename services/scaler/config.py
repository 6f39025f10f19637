"""The scaler's settings: where the KEDA-facing gRPC server listens, its TLS files, and how often it refreshes.
Each is declared once (variable, default, documentation, parsing); docs/configuration.md lists them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import (
    HostPort,
    documented,
    existing_file,
    host_port,
    seconds,
    setting,
    settings_from_env,
)

PEM = existing_file("a PEM file")


@dataclass(frozen=True)
class ScalerTls:
    """TLS of the gRPC server: off without a certificate; mutual when a client CA is given."""

    cert: Path | None = setting(
        "GPUWARDEN_SCALER_TLS_CERT", None, "scaler: serve TLS with this PEM certificate and key", parse=PEM
    )
    key: Path | None = setting(
        "GPUWARDEN_SCALER_TLS_KEY", None, "scaler: the PEM key of GPUWARDEN_SCALER_TLS_CERT", parse=PEM
    )
    client_ca: Path | None = setting(
        "GPUWARDEN_SCALER_TLS_CA", None, "scaler: require client certificates signed by this CA (mTLS)", parse=PEM
    )

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None


@dataclass(frozen=True)
class ScalerSettings:
    listen: HostPort = setting(
        "GPUWARDEN_SCALER_ADDR",
        HostPort("0.0.0.0", 9090),
        "scaler: gRPC listen address of the KEDA external scaler; port 0 takes a free port",
        parse=host_port(),
    )
    tls: ScalerTls = field(default_factory=ScalerTls)
    refresh_s: float = setting(
        "GPUWARDEN_SCALER_REFRESH_S",
        1.0,
        "scaler: seconds between background refreshes of queue depth and utilisation",
        parse=seconds(minimum=0.05, maximum=60),
    )

    @property
    def host(self) -> str:
        return self.listen.host

    @property
    def port(self) -> int:
        return self.listen.port


DOCUMENTED = documented(ScalerSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def load(env: Mapping[str, str] | None = None) -> ScalerSettings:
    """Read the scaler's variables, or raise ``SettingsError`` naming the one that is wrong."""
    settings = settings_from_env(ScalerSettings, env)
    tls = settings.tls
    if (tls.cert is None) != (tls.key is None):
        raise SettingsError("GPUWARDEN_SCALER_TLS_CERT and GPUWARDEN_SCALER_TLS_KEY go together: set both or neither")
    if tls.client_ca is not None and tls.cert is None:
        raise SettingsError("GPUWARDEN_SCALER_TLS_CA (mTLS) needs GPUWARDEN_SCALER_TLS_CERT and _KEY as well")
    return settings
