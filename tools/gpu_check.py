"""``python -m tools.gpu_check [--json] [--xid-wait SECONDS]`` (``make gpu-check``): what the NVML adapter
of the GPU port finds on this machine's GPUs.

It runs every call the services make (devices with memory, NUMA and NVLink topology and MIG mode, driver and CUDA
versions, a utilisation sample) and then listens for XID events for a short while, and prints what it found. A
machine with no NVIDIA driver, no NVML or no GPU is not a failure: it says so ("skipped") and exits 0, so the
check can run anywhere. A step that fails on a machine with GPUs is reported with its error, the other steps still
run, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from shared.adapters.nvml import NvmlGpus
from shared.contract.device import GpuDevice
from shared.ports.gpu import GpuError, GpuHealthEvent, GpuUtilisation

SKIPPED = "no NVIDIA GPU/NVML here: skipped"


@dataclass
class GpuCheck:
    """What the check found. ``failures`` name the step and its error; any failure makes ``status`` failed."""

    status: Literal["ok", "skipped", "failed"] = "ok"
    reason: str = ""
    driver_version: str = ""
    cuda_version: str = ""
    devices: list[GpuDevice] = field(default_factory=list)
    utilisation: list[GpuUtilisation] = field(default_factory=list)
    xid_wait_s: float = 0.0
    health_events: list[GpuHealthEvent] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reason": self.reason,
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "devices": msgspec.to_builtins(self.devices),
            "utilisation": [dataclasses.asdict(u) for u in self.utilisation],
            "xid_wait_s": self.xid_wait_s,
            "health_events": [dataclasses.asdict(e) for e in self.health_events],
            "failures": self.failures,
        }


async def _events(gpus: NvmlGpus, wait_s: float) -> list[GpuHealthEvent]:
    """The health events (XIDs, lost GPUs) seen within ``wait_s``."""
    seen: list[GpuHealthEvent] = []
    events = gpus.health_events()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    try:
        while (left := deadline - loop.time()) > 0:
            try:
                seen.append(await asyncio.wait_for(anext(events), left))
            except (TimeoutError, StopAsyncIteration):
                break
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()
    return seen


async def run_check(gpus: NvmlGpus, xid_wait_s: float = 1.0) -> GpuCheck:
    """Every step once; closes ``gpus``."""
    result = GpuCheck(xid_wait_s=xid_wait_s)
    try:
        try:
            await gpus.open()
        except GpuError as exc:
            result.status, result.reason = "skipped", f"{SKIPPED} ({exc})"
            return result
        try:
            result.devices = await gpus.devices()
        except GpuError as exc:
            result.failures.append(f"devices: {exc}")
        else:
            if not result.devices:
                result.status, result.reason = "skipped", f"{SKIPPED} (NVML started and sees no GPU)"
                return result
        try:
            versions = await gpus.versions()
            result.driver_version, result.cuda_version = versions.driver, versions.cuda
        except GpuError as exc:
            result.failures.append(f"versions: {exc}")
        try:
            result.utilisation = await gpus.utilisation()
        except GpuError as exc:
            result.failures.append(f"utilisation: {exc}")
        if xid_wait_s > 0:
            try:
                result.health_events = await _events(gpus, xid_wait_s)
            except GpuError as exc:
                result.failures.append(f"health events: {exc}")
    finally:
        await gpus.close()
    if result.failures:
        result.status, result.reason = "failed", f"{len(result.failures)} step(s) failed"
    return result


def _mig(gpu: GpuDevice) -> str:
    if not gpu.mig_capable:
        return "not capable"
    if not gpu.mig_enabled:
        return "disabled"
    profiles: dict[str, int] = {}
    for m in gpu.mig_instances:
        profiles[m.profile or "?"] = profiles.get(m.profile or "?", 0) + 1
    listed = ", ".join(f"{p} x{n}" for p, n in sorted(profiles.items()))
    return f"enabled, {len(gpu.mig_instances)} instance(s)" + (f" ({listed})" if listed else "")


def _event(event: GpuHealthEvent) -> str:
    if event.kind == "lost":
        return "GPU is lost" + (f" ({event.message})" if event.message else "")
    return (
        event.message if event.message.startswith(f"XID {event.xid}") else f"XID {event.xid} {event.message}".rstrip()
    )


def render(result: GpuCheck) -> str:
    """The report for a person."""
    if result.status == "skipped":
        return result.reason
    lines = [
        f"NVML: driver {result.driver_version or '?'}, CUDA {result.cuda_version or '?'}, {len(result.devices)} GPU(s)"
    ]
    samples = {u.uuid: u for u in result.utilisation}
    for gpu in result.devices:
        numa = "?" if gpu.numa_node is None else str(gpu.numa_node)
        peers = ", ".join(gpu.nvlink_peers) or "none"
        lines.append(
            f"GPU {gpu.index}  {gpu.uuid}  {gpu.model}  {gpu.memory_total_mib} MiB  bus {gpu.pci_bus_id}  "
            f"NUMA {numa}  NVLink peers: {peers}  MIG: {_mig(gpu)}"
        )
        for m in gpu.mig_instances:
            lines.append(f"  MIG {m.uuid}  {m.profile or '?'}  {m.memory_mib} MiB")
        sample = samples.get(gpu.uuid)
        if sample is not None:
            used = sample.mem_used_mib
            total = used + sample.mem_free_mib
            lines.append(
                f"  utilisation {sample.gpu_util:g}%  memory copy {sample.mem_copy_util:g}%  "
                f"memory {used:.0f}/{total:.0f} MiB  {sample.power_w:.1f} W  {sample.temperature_c:g} C"
            )
    if result.xid_wait_s > 0:
        if result.health_events:
            lines.append(f"health events in {result.xid_wait_s:g}s:")
            lines += [f"  {e.uuid}: {_event(e)}" for e in result.health_events]
        else:
            lines.append(f"health events in {result.xid_wait_s:g}s: none")
    lines += [f"FAILED {failure}" for failure in result.failures]
    lines.append(f"result: {result.status}" + (f" ({result.reason})" if result.reason else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None, nvml: Any = None) -> int:
    """``nvml``: the NVML module to use (tests hand in a fake); pynvml otherwise."""
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument(
        "--xid-wait", type=float, default=1.0, metavar="SECONDS", help="how long to listen for XID events (default 1)"
    )
    args = parser.parse_args(argv)
    if args.xid_wait < 0:
        parser.error(f"--xid-wait {args.xid_wait}: must be zero or more")
    result = asyncio.run(run_check(NvmlGpus(nvml), args.xid_wait))
    print(json.dumps(result.as_json(), indent=2) if args.json else render(result))
    return 1 if result.status == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
