"""The metrics service's settings, from ``GPUWARDEN_METRICS_*`` environment variables; each error names the
variable and what it expects."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import env_choice, env_seconds

SOURCES = ("nvml", "dcgm", "prometheus")
AGGREGATE_MODES = ("local", "bus", "off")
PARSERS = ("cached", "reference")

DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_METRICS_SOURCE": "metrics: nvml, dcgm or prometheus (default nvml)",
    "GPUWARDEN_METRICS_URL": "metrics: the dcgm-exporter page ({node} is replaced by the node; default "
    "http://127.0.0.1:9400/metrics, or the simulated node's exporter in sim mode) or the Prometheus base URL "
    "(required for prometheus)",
    "GPUWARDEN_METRICS_INTERVAL_S": "metrics: seconds between reads of the source (default 5)",
    "GPUWARDEN_METRICS_WINDOW_S": "metrics: seconds of samples behind each pod and deployment aggregate (default 60)",
    "GPUWARDEN_METRICS_STALE_S": "metrics: a sample older than this is stale (default 3 x the interval)",
    "GPUWARDEN_METRICS_TIMEOUT_S": "metrics: deadline of one read of the source (default: the interval, at most 10)",
    "GPUWARDEN_METRICS_AGGREGATE": "metrics: local (what this instance reads), bus (every node's samples on the bus) "
    "or off (default local)",
    "GPUWARDEN_METRICS_SELECTOR": 'metrics: PromQL label matchers narrowing the series, e.g. Hostname="node-1"',
    "GPUWARDEN_METRICS_PARSER": "metrics: cached (validated label sets remembered) or reference (prometheus-client "
    "parser on every line); default cached",
}


@dataclass(frozen=True)
class MetricsSettings:
    source: str = "nvml"
    url: str = ""
    interval_s: float = 5.0
    window_s: float = 60.0
    stale_after_s: float = 15.0
    timeout_s: float = 5.0
    aggregate: str = "local"
    selector: str = ""
    parser: str = "cached"

    def url_for(self, node: str) -> str:
        return self.url.replace("{node}", node)


def load(env: Mapping[str, str] | None = None) -> MetricsSettings:
    """Read and check every metrics setting; raises ``SettingsError`` naming the variable that is wrong."""
    env = os.environ if env is None else env
    source = env_choice(env, "GPUWARDEN_METRICS_SOURCE", SOURCES, "nvml")
    url = env.get("GPUWARDEN_METRICS_URL", "").strip()
    if url:
        parts = urlsplit(url.replace("{node}", "node"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SettingsError(f"GPUWARDEN_METRICS_URL={url!r}: expected an http:// or https:// URL")
    if source == "prometheus" and not url:
        raise SettingsError(
            "GPUWARDEN_METRICS_SOURCE=prometheus needs GPUWARDEN_METRICS_URL, the Prometheus base URL "
            "(e.g. http://prometheus.monitoring:9090)"
        )
    interval = env_seconds(env, "GPUWARDEN_METRICS_INTERVAL_S", 5.0, minimum=0.05)
    window = env_seconds(env, "GPUWARDEN_METRICS_WINDOW_S", 60.0, minimum=0.05)
    if window < interval:
        raise SettingsError(
            f"GPUWARDEN_METRICS_WINDOW_S={window:g} is shorter than GPUWARDEN_METRICS_INTERVAL_S={interval:g}: "
            "a window must hold at least one sample"
        )
    stale = env_seconds(env, "GPUWARDEN_METRICS_STALE_S", 3.0 * interval, minimum=0.05)
    timeout = env_seconds(env, "GPUWARDEN_METRICS_TIMEOUT_S", min(interval, 10.0), minimum=0.05)
    return MetricsSettings(
        source=source,
        url=url,
        interval_s=interval,
        window_s=window,
        stale_after_s=stale,
        timeout_s=timeout,
        aggregate=env_choice(env, "GPUWARDEN_METRICS_AGGREGATE", AGGREGATE_MODES, "local"),
        selector=env.get("GPUWARDEN_METRICS_SELECTOR", "").strip(),
        parser=env_choice(env, "GPUWARDEN_METRICS_PARSER", PARSERS, "cached"),
    )
