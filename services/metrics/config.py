"""The metrics service's settings, from ``GPUWARDEN_METRICS_*`` environment variables, each declared once
(variable, default, documentation, parsing); each error names the variable and what it expects."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import Parse, any_text, choice, documented, seconds, setting, settings_from_env

SOURCES = ("nvml", "dcgm", "prometheus")
AGGREGATE_MODES = ("local", "bus", "off")
PARSERS = ("cached", "reference")


def _http_url(name: str, raw: str) -> str:
    parts = urlsplit(raw.replace("{node}", "node"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(f"{name}={raw!r}: expected an http:// or https:// URL")
    return raw


@dataclass(frozen=True)
class MetricsSettings:
    source: str = setting(
        "GPUWARDEN_METRICS_SOURCE", "nvml", "metrics: nvml, dcgm or prometheus", parse=choice(SOURCES)
    )
    url: str = setting(
        "GPUWARDEN_METRICS_URL",
        "",
        "metrics: the dcgm-exporter page ({node} is replaced by the node; default "
        "http://127.0.0.1:9400/metrics, or the simulated node's exporter in sim mode) or the Prometheus base URL "
        "(required for prometheus)",
        parse=Parse(_http_url),
    )
    interval_s: float = setting(
        "GPUWARDEN_METRICS_INTERVAL_S", 5.0, "metrics: seconds between reads of the source", parse=seconds(minimum=0.05)
    )
    window_s: float = setting(
        "GPUWARDEN_METRICS_WINDOW_S",
        60.0,
        "metrics: seconds of samples behind each pod and deployment aggregate",
        parse=seconds(minimum=0.05),
    )
    stale_after_s: float = setting(
        "GPUWARDEN_METRICS_STALE_S",
        15.0,
        "metrics: a sample older than this is stale",
        parse=seconds(minimum=0.05),
        shown="3 x the interval",
    )
    """Unset: three times ``interval_s`` (``load``)."""
    timeout_s: float = setting(
        "GPUWARDEN_METRICS_TIMEOUT_S",
        5.0,
        "metrics: deadline of one read of the source",
        parse=seconds(minimum=0.05),
        shown="the interval, at most 10",
    )
    """Unset: ``interval_s``, at most 10 (``load``)."""
    aggregate: str = setting(
        "GPUWARDEN_METRICS_AGGREGATE",
        "local",
        "metrics: local (what this instance reads), bus (every node's samples on the bus) or off",
        parse=choice(AGGREGATE_MODES),
    )
    selector: str = setting(
        "GPUWARDEN_METRICS_SELECTOR",
        "",
        'metrics: PromQL label matchers narrowing the series, e.g. Hostname="node-1"',
        parse=any_text(),
    )
    parser: str = setting(
        "GPUWARDEN_METRICS_PARSER",
        "cached",
        "metrics: cached, which remembers the label sets it validated, or reference, the prometheus-client parser "
        "on every line",
        parse=choice(PARSERS),
    )

    def url_for(self, node: str) -> str:
        return self.url.replace("{node}", node)


DOCUMENTED = documented(MetricsSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def load(env: Mapping[str, str] | None = None) -> MetricsSettings:
    """Read and check every metrics setting; raises ``SettingsError`` naming the variable that is wrong."""
    env = os.environ if env is None else env
    settings = settings_from_env(MetricsSettings, env)
    if settings.source == "prometheus" and not settings.url:
        raise SettingsError(
            "GPUWARDEN_METRICS_SOURCE=prometheus needs GPUWARDEN_METRICS_URL, the Prometheus base URL "
            "(e.g. http://prometheus.monitoring:9090)"
        )
    interval, window = settings.interval_s, settings.window_s
    if window < interval:
        raise SettingsError(
            f"GPUWARDEN_METRICS_WINDOW_S={window:g} is shorter than GPUWARDEN_METRICS_INTERVAL_S={interval:g}: "
            "a window must hold at least one sample"
        )
    if not env.get("GPUWARDEN_METRICS_STALE_S", "").strip():
        settings = replace(settings, stale_after_s=3.0 * interval)
    if not env.get("GPUWARDEN_METRICS_TIMEOUT_S", "").strip():
        settings = replace(settings, timeout_s=min(interval, 10.0))
    return settings
