"""A SIMULATED dcgm-exporter: each simulated node serves the exporter's ``/metrics`` page from its ``SimGpus`` state.

The page has dcgm-exporter's metric names, types, units and labels (``../shared/facts/dcgm-exporter.md``): the
default series, labels in the exporter's order (``gpu``, ``UUID``, ``pci_bus_id``, ``device``, ``modelName``, for
MIG slices ``GPU_I_PROFILE`` and ``GPU_I_ID``, ``Hostname``, ``DCGM_FI_DRIVER_VERSION``, then ``pod``,
``namespace``, ``container`` for GPUs a pod uses). So the real chain (exporter text -> scrape or Prometheus ->
metrics service) runs on a laptop.

A MIG-enabled GPU is served as dcgm-exporter serves one: per GPU instance, without ``DCGM_FI_DEV_GPU_UTIL`` (which
MIG does not support) but with ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` and the slice's framebuffer; device-wide series
(power, temperatures, clocks, energy) once for the parent GPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from shared.contract.subjects import Subjects
from shared.plumbing.http import Response, SmallHttpServer
from shared.plumbing.replies import as_text
from shared.ports.gpu import GpuUtilisation
from shared.sim.gpus import SimGpus
from shared.sim.gpustate import SimLoad, mig_profile_slices, sample

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_PORT = 9400
RESERVED_MIB = 512.0
SM_CLOCK_MAX_MHZ = 1980.0
MEM_CLOCK_MHZ = 2619.0

# (name, type, help) in the order dcgm-exporter's default-counters.csv lists them.
SERIES: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB)."),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active."),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active."),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "gauge", "Ratio of cycles the device memory interface is active."),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", "The rate of data transmitted over the PCIe bus (bytes/s)."),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", "The rate of data received over the PCIe bus (bytes/s)."),
)
_DEVICE_WIDE = frozenset(
    {
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_MEM_CLOCK",
        "DCGM_FI_DEV_MEMORY_TEMP",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_XID_ERRORS",
    }
)


@dataclass(frozen=True, slots=True)
class PodRef:
    """The pod the kubelet says uses a GPU."""

    pod: str
    namespace: str
    container: str = "inference"


@dataclass(frozen=True, slots=True)
class ExporterEntity:
    """One labelled target of the page (a whole GPU or one MIG GPU instance) and its values by metric name;
    a metric left out of ``values`` is absent from the page, as on an exporter that lost a field."""

    labels: tuple[tuple[str, str], ...]
    values: Mapping[str, float]
    xid_code: int = 0


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value == int(value) and abs(value) < 2**53 else repr(value)


def render_page(entities: Sequence[ExporterEntity], series: Sequence[tuple[str, str, str]] = SERIES) -> str:
    """The exporter's text format: per metric a HELP and TYPE line, then one sample per entity that has it."""
    label_text = [",".join(f'{k}="{_escape(v)}"' for k, v in e.labels) for e in entities]
    out: list[str] = []
    for name, kind, help_text in series:
        rows = []
        for entity, labels in zip(entities, label_text, strict=True):
            value = entity.values.get(name)
            if value is None:
                continue
            if name == "DCGM_FI_DEV_XID_ERRORS":
                msg = "No Error" if entity.xid_code == 0 else f"Xid {entity.xid_code} (SIMULATED)"
                labels = f'{labels},err_code="{entity.xid_code}",err_msg="{_escape(msg)}"'
            rows.append(f"{name}{{{labels}}} {_number(value)}")
        if rows:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(rows)
    return "\n".join(out) + "\n"


def gpu_labels(
    *,
    index: int,
    uuid: str,
    pci_bus_id: str,
    model: str,
    hostname: str,
    driver_version: str,
    mig: tuple[str, str] | None = None,
    pod: PodRef | None = None,
    hostname_label: str = "Hostname",
    old_pod_labels: bool = False,
) -> tuple[tuple[str, str], ...]:
    """Labels in dcgm-exporter's order; ``hostname_label="hostname"`` and ``old_pod_labels`` give the spellings
    of other releases."""
    labels: list[tuple[str, str]] = [
        ("gpu", str(index)),
        ("UUID", uuid),
        ("pci_bus_id", pci_bus_id),
        ("device", f"nvidia{index}"),
        ("modelName", model),
    ]
    if mig is not None:
        labels += [("GPU_I_PROFILE", mig[0]), ("GPU_I_ID", mig[1])]
    labels += [(hostname_label, hostname), ("DCGM_FI_DRIVER_VERSION", driver_version)]
    if pod is not None:
        if old_pod_labels:
            labels += [("pod_name", pod.pod), ("pod_namespace", pod.namespace), ("container_name", pod.container)]
        else:
            labels += [("pod", pod.pod), ("namespace", pod.namespace), ("container", pod.container)]
    return tuple(labels)


def device_values(u: GpuUtilisation, energy_mj: float, xid: int) -> dict[str, float]:
    """Every default series of a whole GPU from one utilisation sample."""
    busy = u.gpu_util / 100.0
    return {
        "DCGM_FI_DEV_SM_CLOCK": round(210.0 + busy * (SM_CLOCK_MAX_MHZ - 210.0)),
        "DCGM_FI_DEV_MEM_CLOCK": MEM_CLOCK_MHZ,
        "DCGM_FI_DEV_MEMORY_TEMP": round(u.temperature_c + 5.0),
        "DCGM_FI_DEV_GPU_TEMP": round(u.temperature_c),
        "DCGM_FI_DEV_POWER_USAGE": round(u.power_w, 3),
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": round(energy_mj),
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0,
        "DCGM_FI_DEV_GPU_UTIL": round(u.gpu_util),
        "DCGM_FI_DEV_MEM_COPY_UTIL": round(u.mem_copy_util),
        "DCGM_FI_DEV_ENC_UTIL": 0,
        "DCGM_FI_DEV_DEC_UTIL": 0,
        "DCGM_FI_DEV_XID_ERRORS": xid,
        "DCGM_FI_DEV_FB_FREE": round(max(u.mem_free_mib - RESERVED_MIB, 0.0)),
        "DCGM_FI_DEV_FB_USED": round(u.mem_used_mib),
        "DCGM_FI_DEV_FB_RESERVED": RESERVED_MIB,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": round(busy, 6),
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": round(busy * 0.6, 6),
        "DCGM_FI_PROF_DRAM_ACTIVE": round(u.mem_copy_util / 100.0, 6),
        "DCGM_FI_PROF_PCIE_TX_BYTES": round(busy * 2.0e9),
        "DCGM_FI_PROF_PCIE_RX_BYTES": round(busy * 1.0e9),
    }


def mig_values(u: GpuUtilisation, slices: int, slice_gb: int, total_mib: float) -> dict[str, float]:
    """The per-instance series of one MIG slice: the GPU's load spread over its memory share."""
    share = min(slice_gb * 1024.0 / total_mib, 1.0) if total_mib > 0 else 0.0
    size = slice_gb * 1024.0
    used = min(u.mem_used_mib * share, size)
    busy = u.gpu_util / 100.0
    return {
        "DCGM_FI_DEV_FB_FREE": round(size - used),
        "DCGM_FI_DEV_FB_USED": round(used),
        "DCGM_FI_DEV_FB_RESERVED": 0,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": round(busy, 6),
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": round(busy * 0.6, 6),
        "DCGM_FI_PROF_DRAM_ACTIVE": round(u.mem_copy_util / 100.0 * slices / 7.0, 6),
    }


XID_EVENTS = 100
"""Newest health events a page looks through for each GPU's last XID."""


def _last_xids(newest: list[Any]) -> dict[str, int]:
    """Each GPU's last XID, from health entries newest first."""
    found: dict[str, int] = {}
    for _id, fields in newest:
        values = {as_text(k): v for k, v in (fields or {}).items()}
        uuid = as_text(values.get("uuid", b""))
        raw = values.get("xid", b"0")
        if uuid and uuid not in found:
            with contextlib.suppress(ValueError):
                found[uuid] = int(raw)
    return found


def exporter_url_key(subjects: Subjects, node: str) -> str:
    return subjects.redis_key("sim", "exporter", node)


async def find_exporter(client: aioredis.Redis, subjects: Subjects, node: str) -> str | None:
    """The URL of the simulated exporter of ``node``, when a simulation serves one."""
    raw = await client.get(exporter_url_key(subjects, node))
    return None if raw is None else as_text(raw)


PodsOf = Callable[[], Mapping[str, PodRef]]


@dataclass
class SimExporter:
    """Serves one simulated node's exporter page over HTTP (``GET /metrics``), read fresh from Redis on each
    scrape. ``pods`` maps GPU uuids to the pods using them (the workload knows). SIMULATED."""

    gpus: SimGpus
    pods: PodsOf = dict
    hostname_label: str = "Hostname"
    clock: Callable[[], float] = time.monotonic
    port: int = 0
    _energy: dict[str, float] = field(default_factory=dict)
    _last: float | None = None
    http: SmallHttpServer = field(init=False)

    def __post_init__(self) -> None:
        self.http = SmallHttpServer(self._route)

    @property
    def node(self) -> str:
        return self.gpus.node

    async def render(self) -> str:
        state, loads, newest = await self.gpus.page_view(XID_EVENTS)
        xids = _last_xids(newest)
        now = self.clock()
        dt = 0.0 if self._last is None else max(now - self._last, 0.0)
        self._last = now
        pods = self.pods()
        entities: list[ExporterEntity] = []
        for g in state.gpus:
            if g.lost:
                continue
            u = sample(g, loads.get(g.uuid, SimLoad()))
            energy = self._energy[g.uuid] = self._energy.get(g.uuid, 0.0) + u.power_w * dt * 1000.0
            common: dict[str, Any] = {
                "index": g.index,
                "uuid": g.uuid,
                "pci_bus_id": g.pci_bus_id,
                "model": g.model,
                "hostname": self.node,
                "driver_version": state.driver_version,
                "hostname_label": self.hostname_label,
            }
            values = device_values(u, energy, xids.get(g.uuid, 0))
            pod = pods.get(g.uuid)
            if not (g.mig_enabled and g.mig_instances):
                entities.append(ExporterEntity(gpu_labels(**common, pod=pod), values, xid_code=xids.get(g.uuid, 0)))
                continue
            device_wide = {k: v for k, v in values.items() if k in _DEVICE_WIDE}
            entities.append(ExporterEntity(gpu_labels(**common), device_wide, xid_code=xids.get(g.uuid, 0)))
            for gi, instance in enumerate(g.mig_instances, start=1):
                slices, gb = mig_profile_slices(instance.profile)
                entities.append(
                    ExporterEntity(
                        gpu_labels(**common, mig=(instance.profile, str(gi)), pod=pods.get(instance.uuid)),
                        mig_values(u, slices, gb, float(g.memory_mib)),
                    )
                )
        return render_page(entities)

    # -- HTTP -------------------------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve, and announce the URL in Redis (``<root>:sim:exporter:<node>``) for metrics services in sim mode,
        as a Kubernetes Service would make the real exporter findable."""
        self.port = await self.http.start(host, port)
        await self.gpus.client.set(exporter_url_key(self.gpus.subjects, self.node), self.url)
        log.info(
            "SIMULATED dcgm-exporter serving",
            extra={"node": self.node, "url": f"http://{host}:{self.port}/metrics", "simulated": True},
        )
        return self.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    async def stop(self) -> None:
        await self.http.stop()

    async def _route(self, method: str, path: str) -> Response:
        if method != "GET" or path != "/metrics":
            return "404 Not Found", "text/plain", b"try GET /metrics\n"
        return await self.page()

    async def page(self) -> Response:
        """The page as an HTTP answer: 200 with the text, or 500 with why it could not be read."""
        try:
            return "200 OK", CONTENT_TYPE, (await self.render()).encode()
        except Exception as exc:
            log.warning("SIMULATED exporter page failed", extra={"node": self.node, "error": str(exc)})
            return "500 Internal Server Error", "text/plain", f"{exc}\n".encode()


class SimExporterHost:
    """One HTTP server for the SIMULATED dcgm-exporter pages of many nodes: ``GET /nodes/<node>/metrics`` is the
    page that node's ``SimExporter`` renders, as its own server would serve it on ``/metrics``. A simulated fleet
    takes one port, not one per node; each node's URL is announced in Redis where a metrics service in sim mode
    looks for its node's exporter."""

    def __init__(self, exporters: Iterable[SimExporter], client: aioredis.Redis, subjects: Subjects) -> None:
        self.exporters = {e.node: e for e in exporters}
        self.client = client
        self.subjects = subjects
        self.http = SmallHttpServer(self._route)
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve every page and announce every node's URL."""
        self.port = await self.http.start(host, port)
        await self.announce()
        log.info(
            "SIMULATED dcgm-exporters serving",
            extra={"nodes": len(self.exporters), "url": self.url("<node>"), "simulated": True},
        )
        return self.port

    def url(self, node: str) -> str:
        return f"http://127.0.0.1:{self.port}/nodes/{node}/metrics"

    async def announce(self, *, only_missing: bool = False) -> None:
        """Write every node's URL in one round trip (``only_missing``: where none is announced, as after Redis
        came back empty)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for node in self.exporters:
                pipe.set(exporter_url_key(self.subjects, node), self.url(node), nx=only_missing)
            await pipe.execute()

    async def announced(self) -> bool:
        """Whether the first and the last node's URLs are still in Redis (one round trip: what a Redis that came
        back empty lacks)."""
        nodes = list(self.exporters)
        keys = {exporter_url_key(self.subjects, node) for node in (nodes[:1] + nodes[-1:])}
        return not keys or int(await self.client.exists(*keys)) == len(keys)

    async def stop(self) -> None:
        await self.http.stop()

    async def _route(self, method: str, path: str) -> Response:
        parts = path.strip("/").split("/")
        exporter = self.exporters.get(parts[1]) if len(parts) == 3 and parts[0] == "nodes" else None
        if method != "GET" or exporter is None or parts[2] != "metrics":
            return "404 Not Found", "text/plain", b"try GET /nodes/<node>/metrics\n"
        return await exporter.page()
