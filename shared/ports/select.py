"""Which adapter a service gets for a port, from its settings. Services call these and depend on the Protocols."""

from __future__ import annotations

from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.configsync import redis_client
from shared.plumbing.settings import Settings
from shared.ports.cluster import ClusterPort
from shared.ports.gpu import GpuPort
from shared.sim.cluster import SimCluster
from shared.sim.faults import serve_faults
from shared.sim.gpus import SimGpus
from shared.sim.spec import SpecError, load_spec


def gpu_port(settings: Settings, subjects: Subjects) -> GpuPort:
    """The node's GPUs: NVML for backend ``real``; simulated from the node spec (``GPUWARDEN_SIM_SPEC``, or the
    default spec) for backend ``sim``. Raises ``SpecError`` for a bad spec or a node the spec lacks, before
    anything is started."""
    if settings.backend != "sim":
        from shared.ports.nvml import NvmlGpus

        return NvmlGpus()
    spec = load_spec()
    try:
        spec.node(settings.node)
    except SpecError as exc:
        raise SpecError(
            f"GPUWARDEN_NODE={settings.node}: {exc}; set GPUWARDEN_NODE to one of them, or GPUWARDEN_SIM_SPEC to a "
            "spec with this node"
        ) from None
    return SimGpus(redis_client(settings.redis), subjects, spec, settings.node, owns_client=True)


async def serve_sim_faults(port: GpuPort, bus: Bus) -> bool:
    """Answer fault-injection requests on the bus when ``port`` is simulated; says whether it does."""
    if not isinstance(port, SimGpus):
        return False
    await serve_faults(bus, port.client, port.subjects, port.spec)
    return True


async def cluster_port(settings: Settings, subjects: Subjects, **kube_options: object) -> ClusterPort:
    """The cluster: simulated (in Redis, created from the spec if absent) for backend ``sim``; the Kubernetes API
    (in-cluster ServiceAccount, else kubeconfig) for ``real``. ``kube_options``: watch_kinds, watch_node."""
    if settings.backend == "sim":
        return await SimCluster.create(settings.redis, subjects)
    from shared.ports.kube import KubeCluster

    return await KubeCluster.connect(**kube_options)  # type: ignore[arg-type]
