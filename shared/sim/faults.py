"""Fault injection for the simulated GPUs: what a real node does to the services, on request.

A fault changes the simulated node's state in Redis (see ``shared.sim.gpustore``), so the services notice it the way
they would notice the real thing: an XID or a lost GPU arrives on the GPU port's health stream, a driver install
fails or hangs inside ``install_driver``, a MIG change fails or hangs inside ``set_mig_mode`` and the MIG instance
calls, slow copies show in ``copy_slowdown`` and in the copy utilisation.

Requests are JSON, validated strictly (unknown fields are refused), and every refusal names the field::

    {"kind": "xid", "node": "node-1", "gpu": 0, "code": 79, "message": "GPU has fallen off the bus"}
    {"kind": "lose_gpu", "node": "node-1", "gpu": "GPU-..."}
    {"kind": "driver_install", "node": "node-1", "mode": "fail", "reason": "DKMS build failed"}
    {"kind": "mig", "node": "node-1", "mode": "hang"}
    {"kind": "slow_copies", "node": "node-1", "gpu": 1, "factor": 4.0}
    {"kind": "kill_pod", "pod": "llama-2", "namespace": "llm"}
    {"kind": "lose_node", "node": "node-2"}

``gpu`` is an index or a UUID. ``driver_install`` modes are ``fail`` and ``hang`` (every install until
``clear``); ``mig`` the same for every MIG change. ``slow_copies`` with ``factor`` 1.0 makes copies normal again.
``kill_pod`` kills an inference pod outright (an OOM kill, an engine crash): it is gone at once, with no preStop
and its memory with it, and its deployment makes a new one; its sessions go on from what their checkpoints and
journal hold (``namespace`` may be left out when one namespace has a pod of that name). ``lose_gpu`` kills the pods
holding that GPU the same way: their KV was in its memory, which no save can read any more. ``lose_node`` makes
the node NotReady for good and kills every pod on it the same way (its memory and local disk gone).

Three ways in: ``apply_fault`` (a library call), ``serve_faults`` (core NATS request/reply on
``<root>.cmd.sim.fault``, answered with ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``) and
``fault_cli`` (``gpuwarden sim fault <kind> ...``, straight to Redis).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.contract.base import TOKEN_PATTERN, OptNamespace, PodName
from shared.contract.subjects import Subjects
from shared.plumbing.bus import Bus
from shared.plumbing.settings import Settings
from shared.ports.gpu import GpuError, GpuHealthEvent
from shared.sim.gpustate import SimGpu, SimNodeState, initial_state
from shared.sim.gpustore import SimGpuStore
from shared.sim.spec import SimSpec, SpecError

log = logging.getLogger(__name__)

# What the driver prints for the XIDs people meet most (NVIDIA's XID catalogue), used when a fault gives none.
XID_MESSAGES: dict[int, str] = {
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors",
    48: "Double Bit ECC Error",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "NVDEC0 Exception",
    74: "NVLINK Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    109: "Context Switch Timeout Error",
    119: "GSP RPC Timeout",
    120: "GSP Error",
}

NodeName = Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)]
GpuIndex = Annotated[int, msgspec.Meta(ge=0)]
GpuRef = GpuIndex | str
XidCode = Annotated[int, msgspec.Meta(ge=1, le=255)]
Slowdown = Annotated[float, msgspec.Meta(ge=1.0, le=1000.0)]


class FaultError(ValueError):
    """A fault request that cannot be applied. The message names the field (``$.code``, ``$.gpu``)."""


class _Fault(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    @property
    def kind(self) -> str:
        return str(type(self).__struct_config__.tag)


class _NodeFault(_Fault, frozen=True, kw_only=True):
    node: NodeName


class KillPodFault(_Fault, frozen=True, kw_only=True, tag="kill_pod"):
    """The pod dies at once (OOM kill, engine crash, ``kill -9``): no preStop, its memory gone; its deployment
    replaces it."""

    pod: PodName
    namespace: OptNamespace = ""


class LoseNodeFault(_NodeFault, frozen=True, kw_only=True, tag="lose_node"):
    """The node is gone (power, kernel panic, network): NotReady for good, its pods dead with their memory and its
    local disk; their deployments replace them on other nodes."""


class XidFault(_NodeFault, frozen=True, kw_only=True, tag="xid"):
    """The driver reports XID ``code`` on a GPU."""

    gpu: GpuRef
    code: XidCode
    message: str = ""


class LoseGpuFault(_NodeFault, frozen=True, kw_only=True, tag="lose_gpu"):
    """The GPU falls off the bus: it leaves the device list for good."""

    gpu: GpuRef


class DriverInstallFault(_NodeFault, frozen=True, kw_only=True, tag="driver_install"):
    """From now on every driver install on the node fails or hangs, until ``mode`` is ``clear``."""

    mode: Literal["fail", "hang", "clear"]
    reason: str = ""


class MigChangeFault(_NodeFault, frozen=True, kw_only=True, tag="mig"):
    """From now on every MIG change on the node (mode, create, destroy) fails or hangs, until ``mode`` is
    ``clear``."""

    mode: Literal["fail", "hang", "clear"]
    reason: str = ""


class SlowCopiesFault(_NodeFault, frozen=True, kw_only=True, tag="slow_copies"):
    """Copies off the GPU take ``factor`` times as long (1.0: normal again)."""

    gpu: GpuRef
    factor: Slowdown


SimFault = (
    XidFault | LoseGpuFault | DriverInstallFault | MigChangeFault | SlowCopiesFault | KillPodFault | LoseNodeFault
)
FAULT_KINDS: tuple[str, ...] = ("xid", "lose_gpu", "driver_install", "slow_copies", "mig", "kill_pod", "lose_node")

_decoder = msgspec.json.Decoder(SimFault)


def _explain(exc: msgspec.ValidationError) -> FaultError:
    text = str(exc)
    if "`$.kind`" in text or "field `kind`" in text:
        text += f" (kinds: {', '.join(FAULT_KINDS)})"
    return FaultError(text)


def parse_fault(raw: bytes | str) -> SimFault:
    """A fault from JSON, or ``FaultError`` naming the field that is wrong."""
    try:
        return _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise _explain(exc) from None
    except msgspec.DecodeError as exc:
        raise FaultError(f"not valid JSON: {exc}") from None


def fault_from_fields(fields: dict[str, Any]) -> SimFault:
    """A fault from loosely typed values (command-line strings): ``"79"`` is accepted for a number."""
    try:
        return msgspec.convert(fields, SimFault, strict=False)
    except msgspec.ValidationError as exc:
        raise _explain(exc) from None


def _gpu(state: SimNodeState, ref: int | str) -> SimGpu:
    for g in state.gpus:
        if (g.index if isinstance(ref, int) else g.uuid) == ref:
            if g.lost:
                raise FaultError(f"$.gpu: GPU {g.index} ({g.uuid}) on {state.node} is already lost")
            return g
    known = ", ".join(f"{g.index} ({g.uuid})" for g in state.gpus if not g.lost) or "none left"
    raise FaultError(f"$.gpu: {state.node} has no GPU {ref!r} (GPUs: {known})")


async def _node_state(store: SimGpuStore, node: str, spec: SimSpec | None) -> SimNodeState:
    state = await store.read(node)
    if state is None and spec is not None and node in {n.name for n in spec.nodes}:
        state, _ = await store.ensure(initial_state(spec, node, store.subjects.root))
    if state is None:
        known = sorted({*(await store.nodes()), *(n.name for n in spec.nodes)} if spec else await store.nodes())
        raise FaultError(f"$.node: {node!r} has no simulated GPUs (nodes: {', '.join(known) or 'none yet'})")
    return state


async def apply_fault(client: aioredis.Redis, subjects: Subjects, fault: SimFault, spec: SimSpec | None = None) -> str:
    """Apply ``fault`` to the simulated node's state and return what was done, in words.

    The node must have simulated GPUs: state in Redis, or a node of ``spec`` (whose state is then created, as a
    service attaching would). Raises ``FaultError`` naming the field for an unknown node or GPU, or a GPU that is
    already lost. Not idempotent for ``xid`` (each call is one more XID), idempotent for the others
    (``kill_pod`` of a pod already gone is refused, naming it).
    """
    if isinstance(fault, KillPodFault):
        return await _kill_pod(client, subjects, fault)
    if isinstance(fault, LoseNodeFault):
        return await _lose_node(client, subjects, fault)
    store = SimGpuStore(client, subjects)
    node = fault.node
    state = await _node_state(store, node, spec)
    match fault:
        case XidFault():
            gpu = _gpu(state, fault.gpu)
            message = fault.message or XID_MESSAGES.get(fault.code, "")
            await store.emit(node, GpuHealthEvent(uuid=gpu.uuid, kind="xid", xid=fault.code, message=message))
            done = f"XID {fault.code} raised on {node} GPU {gpu.index} ({gpu.uuid})"
        case LoseGpuFault():
            gpu = _gpu(state, fault.gpu)

            def lose(s: SimNodeState) -> tuple[SimNodeState, None]:
                return s.replace_gpu(msgspec.structs.replace(_gpu(s, gpu.index), lost=True)), None

            lost = GpuHealthEvent(uuid=gpu.uuid, kind="lost", message="GPU has fallen off the bus")
            await _update(store, node, lose, (lost,))
            killed = await _kill_holders(client, subjects, node, gpu.index)
            done = f"{node} GPU {gpu.index} ({gpu.uuid}) is lost" + (
                f"; the pods holding it died with their memory: {', '.join(killed)}" if killed else ""
            )
        case DriverInstallFault():
            mode: Literal["", "fail", "hang"] = "" if fault.mode == "clear" else fault.mode

            def install(s: SimNodeState) -> tuple[SimNodeState, None]:
                return msgspec.structs.replace(s, install_fault=mode, install_fault_reason=fault.reason), None

            await _update(store, node, install)
            done = f"driver installs on {node}: " + (f"{mode} {fault.reason}".strip() if mode else "normal again")
        case MigChangeFault():
            mig: Literal["", "fail", "hang"] = "" if fault.mode == "clear" else fault.mode

            def mig_change(s: SimNodeState) -> tuple[SimNodeState, None]:
                return msgspec.structs.replace(s, mig_fault=mig, mig_fault_reason=fault.reason), None

            await _update(store, node, mig_change)
            done = f"MIG changes on {node}: " + (f"{mig} {fault.reason}".strip() if mig else "normal again")
        case SlowCopiesFault():
            gpu = _gpu(state, fault.gpu)

            def slow(s: SimNodeState) -> tuple[SimNodeState, None]:
                current = _gpu(s, gpu.index)
                return s.replace_gpu(msgspec.structs.replace(current, copy_slowdown=fault.factor)), None

            await _update(store, node, slow)
            done = f"copies on {node} GPU {gpu.index} ({gpu.uuid}) run {fault.factor:g}x slower"
    log.warning("SIMULATED fault injected", extra={"fault": fault.kind, "node": node, "done": done})
    return done


async def _kill_pod(client: aioredis.Redis, subjects: Subjects, fault: KillPodFault) -> str:
    from shared.sim.cluster import SimCluster  # the cluster, only for the fault that acts on it

    cluster = SimCluster(client, subjects)
    killed = await cluster.kill_pod(fault.namespace, fault.pod)
    if killed is None:
        where = f" in namespace {fault.namespace}" if fault.namespace else ""
        raise FaultError(f"$.pod: no running pod {fault.pod!r}{where} (or several: name the namespace)")
    done = f"pod {killed.namespace}/{killed.name} on {killed.node} killed: no preStop, its memory gone"
    log.warning("SIMULATED fault injected", extra={"fault": fault.kind, "pod": fault.pod, "done": done})
    return done


async def _lose_node(client: aioredis.Redis, subjects: Subjects, fault: LoseNodeFault) -> str:
    from shared.sim.cluster import SimCluster  # the cluster, only for the faults that act on it

    cluster = SimCluster(client, subjects)
    if not await cluster.present():
        raise FaultError("$.node: there is no simulated cluster to lose a node of")
    known = [n.name for n in await cluster.nodes()]
    if fault.node not in known:
        raise FaultError(f"$.node: no node {fault.node!r} in the simulated cluster (nodes: {', '.join(known)})")
    killed = await cluster.lose_node(fault.node)
    done = f"{fault.node} is lost (NotReady); its pods died with their memory: {', '.join(killed) or 'none'}"
    log.warning("SIMULATED fault injected", extra={"fault": fault.kind, "node": fault.node, "done": done})
    return done


async def _kill_holders(client: aioredis.Redis, subjects: Subjects, node: str, index: int) -> list[str]:
    """The pods holding a GPU that fell off the bus die with it: their KV lived in its memory, which no save can
    read any more (the engine's next CUDA call fails). Killed as ``kill_pod`` kills (no preStop, memory gone), so
    their sessions go on only from what was journaled or checkpointed before. Their names; none without a
    simulated cluster (GPUs simulated alone)."""
    from shared.sim.cluster import SimCluster  # the cluster, only for the faults that act on it

    cluster = SimCluster(client, subjects)
    if not await cluster.present():
        return []
    killed = []
    for holder in (await cluster.gpu_holders(node)).get(index, []):
        namespace, _, name = holder.partition("/")
        if await cluster.kill_pod(namespace, name) is not None:
            killed.append(holder)
    return killed


async def _update(store: SimGpuStore, node: str, change: Any, health: Sequence[GpuHealthEvent] = ()) -> None:
    try:
        await store.update(node, change, health)
    except GpuError as exc:
        raise FaultError(f"$.node: {exc}") from None


# -- over NATS ----------------------------------------------------------------------------------------------------
def _reply(ok: bool, text: str) -> bytes:
    body: dict[str, Any] = {"ok": ok, "simulated": True}
    body["applied" if ok else "error"] = text
    return json.dumps(body).encode()


async def serve_faults(
    bus: Bus, client: aioredis.Redis, subjects: Subjects, spec: SimSpec | None = None, queue: str = "sim-faults"
) -> Subscription:
    """Answer fault requests on ``<root>.cmd.sim.fault``. Servers share the ``queue`` group, so a fault sent
    while several simulated nodes run is applied once. The request is JSON (the module docstring shows it); the
    reply is ``{"ok": true, "simulated": true, "applied": "..."}`` or ``{"ok": false, ..., "error": "..."}``."""

    async def on_msg(msg: Msg) -> None:
        try:
            answer = _reply(True, await apply_fault(client, subjects, parse_fault(msg.data), spec))
        except FaultError as exc:
            answer = _reply(False, str(exc))
        except (redis.exceptions.RedisError, OSError) as exc:
            answer = _reply(False, f"the simulated GPU state in Redis is unreachable: {type(exc).__name__}: {exc}")
        except Exception as exc:
            log.exception("SIMULATED fault request failed", extra={"subject": msg.subject})
            answer = _reply(False, f"{type(exc).__name__}: {exc}")
        if msg.reply:
            await msg.respond(answer)

    return await bus.nc.subscribe(subjects.command("sim", "fault"), queue=queue, cb=on_msg)


async def request_fault(bus: Bus, fault: SimFault, timeout: float = 5.0) -> str:
    """Send ``fault`` to whichever service serves fault requests; returns what it did or raises ``FaultError``."""
    reply = await bus.nc.request(bus.subjects.command("sim", "fault"), msgspec.json.encode(fault), timeout=timeout)
    body = json.loads(reply.data)
    if not body.get("ok"):
        raise FaultError(str(body.get("error", "refused")))
    return str(body.get("applied", ""))


# -- from the command line ----------------------------------------------------------------------------------------
FAULT_CLI = "gpuwarden sim fault"


def add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    """The fault kinds and their options, as sub-commands of ``parser`` (``gpuwarden sim fault``)."""
    parser.description = "Inject a fault into the SIMULATED GPUs or pods: written to Redis, seen by every service."
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")

    def node_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--node", required=True, help="the simulated node, e.g. node-1")

    def gpu_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--gpu", required=True, help="GPU index or UUID")

    p = kinds.add_parser("xid", help="the driver reports an XID error on a GPU")
    node_arg(p)
    gpu_arg(p)
    p.add_argument("--code", required=True, help="XID code, 1-255 (79: fallen off the bus; 13: application)")
    p.add_argument("--message", default="", help="driver message (default: the usual text for the code)")
    p = kinds.add_parser(
        "lose_gpu", help="a GPU falls off the bus and leaves the device list; the pods holding it die with its memory"
    )
    node_arg(p)
    gpu_arg(p)
    p = kinds.add_parser("driver_install", help="make every driver install fail or hang, or clear that")
    node_arg(p)
    p.add_argument("--mode", required=True, help="fail, hang or clear")
    p.add_argument("--reason", default="", help="what the failed install says")
    p = kinds.add_parser("mig", help="make every MIG change (mode, create, destroy) fail or hang, or clear that")
    node_arg(p)
    p.add_argument("--mode", required=True, help="fail, hang or clear")
    p.add_argument("--reason", default="", help="what the failed MIG change says")
    p = kinds.add_parser("slow_copies", help="copies off a GPU take FACTOR times as long (1: normal)")
    node_arg(p)
    gpu_arg(p)
    p.add_argument("--factor", required=True, help="slowdown, at least 1.0")
    p = kinds.add_parser("lose_node", help="a node is gone: NotReady, its pods dead with their memory")
    node_arg(p)
    p = kinds.add_parser("kill_pod", help="kill an inference pod outright: no preStop, its memory gone")
    p.add_argument("pod", help="the pod, e.g. llama-2")
    p.add_argument("--namespace", default="", help="its namespace (default: the one namespace holding such a pod)")


def fault_from_args(args: argparse.Namespace) -> SimFault:
    fields = {
        k: v
        for k, v in vars(args).items()
        if k in {"kind", "node", "gpu", "code", "message", "mode", "reason", "factor", "pod", "namespace"}
    }
    if fields.get("kind") == "kill_pod" and not fields.get("namespace"):
        fields.pop("namespace", None)
    gpu = fields.get("gpu")
    if isinstance(gpu, str) and gpu.isdigit():
        fields["gpu"] = int(gpu)
    return fault_from_fields(fields)


def run_fault(args: argparse.Namespace, settings: Settings) -> int:
    """Apply the fault ``args`` describe (parsed by ``add_fault_arguments``) through Redis. Exit status 0 when
    applied, 2 for a bad request (the message names the field) or spec, 1 when Redis cannot be reached."""
    from shared.plumbing.configsync import redis_client, redis_unreachable
    from shared.plumbing.settings import public_url
    from shared.sim.spec import load_spec

    try:
        fault = fault_from_args(args)
        spec = load_spec()
    except (FaultError, SpecError) as exc:
        print(f"{FAULT_CLI}: {exc}", file=sys.stderr)
        return 2

    async def main() -> str:
        client = redis_client(settings.redis)
        try:
            return await apply_fault(client, Subjects(settings.root), fault, spec)
        finally:
            await client.aclose()

    try:
        done = asyncio.run(main())
    except FaultError as exc:
        print(f"{FAULT_CLI}: {exc}", file=sys.stderr)
        return 2
    except (redis.exceptions.RedisError, OSError) as exc:
        if redis_unreachable(exc):
            print(f"{FAULT_CLI}: Redis at {public_url(settings.redis.url)} is unreachable", file=sys.stderr)
        else:
            print(f"{FAULT_CLI}: Redis failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"ok": True, "simulated": True, "applied": done}))
    return 0


def fault_cli(argv: Sequence[str], settings: Settings | None = None) -> int:
    """``gpuwarden sim fault KIND --node N ...`` on its own: parse ``argv`` and ``run_fault``."""
    from shared.plumbing.errors import SettingsError
    from shared.plumbing.settings import load_settings

    parser = argparse.ArgumentParser(prog=FAULT_CLI)
    add_fault_arguments(parser)
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        settings = settings or load_settings()
    except SettingsError as exc:
        print(f"{FAULT_CLI}: {exc}", file=sys.stderr)
        return 2
    return run_fault(args, settings)
