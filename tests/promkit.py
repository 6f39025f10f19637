"""Where the shipped Prometheus rules and Grafana dashboard lie, and a dashboard query as Prometheus takes it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus"
GRAFANA_RANGES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def promql(expr: str) -> str:
    """A dashboard query as Prometheus takes it: Grafana's range variables filled in."""
    for variable, value in GRAFANA_RANGES.items():
        expr = expr.replace(variable, value)
    return expr
