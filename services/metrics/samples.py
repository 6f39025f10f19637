"""The metrics service's pure steps: a source's reading as an observation and as a GPU sample (fields it
lacks named in ``missing``), and an aggregate as the record and event the scaler reads."""

from __future__ import annotations

from datetime import UTC, datetime

from shared.contract.base import is_token
from shared.contract.metrics import DeploymentUtilisation, GpuSample, UtilisationRecord
from shared.ports.metrics import GpuReading

from .aggregate import Aggregate, Observation

SAMPLE_FIELDS = ("gpu_util", "mem_copy_util", "mem_used_mib", "mem_free_mib", "power_w", "temperature_c")


def observation(reading: GpuReading, read_at: float) -> Observation:
    return Observation(
        key=reading.key,
        t=reading.timestamp if reading.timestamp is not None else read_at,
        util=reading.util,
        mem_used_mib=reading.get("mem_used_mib"),
        mem_free_mib=reading.get("mem_free_mib"),
        mem_reserved_mib=reading.get("mem_reserved_mib"),
        node=reading.node,
        pod=reading.pod,
        namespace=reading.namespace,
    )


def gpu_sample(reading: GpuReading, node: str, read_at: float) -> GpuSample | None:
    """The event for one reading; None when it has no utilisation (nothing to publish but a guess)."""
    util = reading.util
    if util is None:
        return None
    v = reading.values
    at = reading.timestamp if reading.timestamp is not None else read_at
    return GpuSample(
        node=node,
        gpu_uuid=reading.uuid,
        gpu_util=util,
        mem_copy_util=v.get("mem_copy_util"),
        mem_used_mib=v.get("mem_used_mib"),
        mem_free_mib=v.get("mem_free_mib"),
        power_w=v.get("power_w"),
        temperature_c=v.get("temperature_c"),
        xid=None if (xid := v.get("xid")) is None else int(xid),
        pod=reading.pod,
        namespace=reading.namespace,
        sampled_at=datetime.fromtimestamp(at, UTC),
        gpu_instance_id=reading.gpu_instance_id,
        mig_profile=reading.mig_profile,
        missing=[f for f in SAMPLE_FIELDS[1:] if f not in v],
    )


def observation_of_sample(event: GpuSample) -> Observation:
    """A published sample as a point; a value it lacks stays unknown (None, or named in ``missing`` by a
    publisher from before values could be None)."""
    missing = set(event.missing)
    t = (event.sampled_at or event.occurred_at).timestamp()
    key = f"{event.gpu_uuid}/gi{event.gpu_instance_id}" if event.gpu_instance_id else event.gpu_uuid
    return Observation(
        key=key,
        t=t,
        util=event.gpu_util,
        mem_used_mib=None if "mem_used_mib" in missing else event.mem_used_mib,
        mem_free_mib=None if "mem_free_mib" in missing else event.mem_free_mib,
        node=event.node,
        pod=event.pod,
        namespace=event.namespace,
    )


def record(a: Aggregate, written_at: float) -> UtilisationRecord:
    return UtilisationRecord(
        namespace=a.namespace,
        name=a.name,
        scope=a.scope,
        window_s=a.window_s,
        mean_util=a.mean_util,
        max_util=a.max_util,
        mem_pressure=a.mem_pressure,
        gpus=a.gpus,
        stale_gpus=a.stale_gpus,
        pods=a.pods,
        samples=a.samples,
        sampled_at=a.sampled_at,
        written_at=written_at,
        stale=a.stale,
    )


def deployment_event(a: Aggregate) -> DeploymentUtilisation | None:
    """The event for a deployment's figures; None with no utilisation in the window (nothing true to say)."""
    if a.mean_util is None or a.max_util is None or not (is_token(a.namespace) and is_token(a.name)):
        return None
    return DeploymentUtilisation(
        namespace=a.namespace,
        deployment=a.name,
        window_s=a.window_s,
        mean_util=a.mean_util,
        max_util=a.max_util,
        mem_pressure=a.mem_pressure,
        gpus=a.gpus - a.stale_gpus,
        sampled_at=None if a.sampled_at is None else datetime.fromtimestamp(a.sampled_at, UTC),
        pods=a.pods,
        samples=a.samples,
        stale=a.stale,
    )
