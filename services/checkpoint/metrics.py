"""The checkpoint service's metrics, declared once on the service's registry: what the drains, saves, restores,
periodic checkpoints and location events count (docs/observability.md lists them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.contract.node import DrainOutcome


class CheckpointMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.bytes = Counter("gpuwarden_checkpoint_bytes_total", "Bytes committed to checkpoints", ["kind"], registry=r)
        self.sessions = Counter(
            "gpuwarden_checkpoint_sessions_total", "Sessions saved, by outcome", ["outcome"], registry=r
        )
        self.refused = Counter(
            "gpuwarden_checkpoint_stale_refused_total",
            "Saves, announcements and claims of sessions by pods that no longer own them, refused, and stale saves a"
            " restore passed over (what: save, announcement, claim, repair)",
            ["what"],
            registry=r,
        )
        self.fallbacks = Counter(
            "gpuwarden_checkpoint_restore_fallbacks_total",
            "Newer checkpoints passed over by restores (missing, unreadable, corrupt)",
            registry=r,
        )
        self.drain = Histogram(
            "gpuwarden_drain_seconds",
            "Time from taking a drain to its verdict",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120),
            registry=r,
        )
        self.drain_rate = Gauge(
            "gpuwarden_checkpoint_last_drain_bytes_per_second", "Bytes per second the last drain saved", registry=r
        )
        self.periodic = Histogram(
            "gpuwarden_checkpoint_periodic_save_seconds",
            "Time a pod's periodic save took (command to report)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.periodic_pods = Gauge(
            "gpuwarden_checkpoint_periodic_pods",
            "Live pods this replica saves periodically (its share)",
            registry=r,
        )
        self.repaired = Counter(
            "gpuwarden_checkpoint_registry_repaired_total",
            "Checkpoints the registry had lost (a Redis failover) that restores found in the store and recorded again",
            registry=r,
        )
        self.scrub_checked = Counter(
            "gpuwarden_checkpoint_scrub_checked_total",
            "Recorded checkpoints the scrub checked against the store (manifest and packs present and long enough)",
            registry=r,
        )
        self.scrub_forgotten = Counter(
            "gpuwarden_checkpoint_scrub_forgotten_total",
            "Recorded checkpoints the scrub forgot, their files gone or damaged (reason: manifest, pack, rot)",
            ["reason"],
            registry=r,
        )
        self.rewrites = Counter(
            "gpuwarden_checkpoint_rewrites_marked_total",
            "Sessions marked for a full next save (a checkpoint of theirs lost a file), by who found it (scrub, save)",
            ["by"],
            registry=r,
        )
        self.scrub_restarts = Counter(
            "gpuwarden_checkpoint_scrub_restarts_total",
            "Scrub walks started again from the beginning because Redis changed (its run id: a promotion, a restart)",
            registry=r,
        )
        self.locations = Counter(
            "gpuwarden_kv_session_locations_total",
            "kv.session.location events, by outcome (published, or lost: routers then ask where)",
            ["outcome"],
            registry=r,
        )
        self.verdicts = Counter(
            "gpuwarden_drain_verdicts_total",
            "Drains decided here, by verdict (completed, failed)",
            ["outcome"],
            registry=r,
        )
        for outcome in get_args(DrainOutcome):  # both series exist from the start, at 0: the first one counts
            self.verdicts.labels(outcome)
        self.restores = Counter(
            "gpuwarden_checkpoint_restores_total",
            "Sessions restored by a pod from a checkpoint whose every chunk digest it verified",
            registry=r,
        )
        self.tokens_recomputed = Counter(
            "gpuwarden_checkpoint_tokens_recomputed_total",
            "Tokens restored sessions computed again after their checkpoint (what a pod lost without a final save"
            " cost: at most a block per session with the KV journal on), as the restoring pods report them",
            registry=r,
        )
        self.periodic_missed = Counter(
            "gpuwarden_checkpoint_periodic_missed_total",
            "Periodic checkpoints a pod was due that it did not take (its agent did not answer, or refused)",
            registry=r,
        )
        self.periodic_late = Counter(
            "gpuwarden_checkpoint_periodic_late_total",
            "Periodic saves started more than 5 s after they were due (the pod's last save was still running)",
            registry=r,
        )
        self.periodic_tick = Gauge(
            "gpuwarden_checkpoint_periodic_tick_timestamp_seconds",
            "When the periodic loop last looked for pods due a save (seconds since the epoch; 0: not yet)",
            registry=r,
        )
        self.periodic_interval = Gauge(
            "gpuwarden_checkpoint_periodic_interval_seconds",
            "The checkpoint document's periodic_interval_s (0: periodic checkpoints off)",
            registry=r,
        )

    def follow(self, periodic_share: Callable[[], float], periodic_interval: Callable[[], float]) -> None:
        """The gauges read at each scrape: this replica's share of periodic saves, and the interval in force."""
        self.periodic_pods.set_function(periodic_share)
        self.periodic_interval.set_function(periodic_interval)
