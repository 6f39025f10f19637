"""A rolling driver upgrade with every node's device service a DRA driver: each node's ResourceSlice says the new
``driverVersion`` only once that node's drain has completed (its sessions saved and its pods evicted), every node
ends upgraded with its slice on the new version, no session is lost, and the checker is clean after it."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.device.config import DeviceSettings
from services.device.service import DeviceService
from shared.contract.annotations import UPGRADE_STATE_LABEL
from shared.contract.configdocs import DriverPolicy
from shared.host.runner import RunningService, start_service
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.settings import Settings
from shared.ports.cluster import Semver
from shared.sim.gpus import SimGpus
from shared.wiring import Wiring
from tests.faults.fleet import NEW_DRIVER, fleet
from tests.helpers import eventually

AFTER_THE_DRAIN = frozenset({"pod-deletion-required", "pod-restart-required", "validation-required"}) | frozenset(
    {"uncordon-required", "upgrade-done"}
)
"""The upgrade states a node is in once its drain completed (docs/driver.md): the install happens in the first two."""


@pytest.fixture
def folder() -> Iterator[Path]:
    """Short on purpose: the DRA drivers' unix sockets must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gw-drau-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def dra(folder: Path) -> DeviceSettings:
    return DeviceSettings(
        api="dra",
        inventory_s=0.1,
        plugin_dir=folder / "dp",
        dra_plugin_dir=folder / "plugin",
        dra_registry_dir=folder / "registry",
        kubelet_poll_s=0.1,
        cdi_dir=folder / "cdi",
    )


async def test_each_nodes_slice_says_the_new_driver_only_after_its_drain(
    settings: Settings, tmp_path: Path, folder: Path
) -> None:
    async with fleet(settings, tmp_path) as f:
        sessions = await f.begin(9)
        devices: list[RunningService] = []
        for node in f.spec.nodes:
            gpus = SimGpus(f.client, f.subjects, f.spec, node.name)
            service = DeviceService(dra(folder / node.name), gpus=gpus, cluster=f.cluster)
            devices.append(await start_service(service, dataclasses.replace(settings, node=node.name), Wiring))
        try:

            async def versions() -> dict[str, str]:
                found = {}
                for stored in (await f.cluster.resources.slices()).values():
                    named = {d.attributes.get("driverVersion") for d in stored.slice.devices}
                    assert len(named) == 1, f"{stored.slice.node}: devices of several driver versions {named}"
                    (version,) = named
                    found[stored.slice.node] = version.value if isinstance(version, Semver) else str(version)
                return found

            async def every_node() -> dict[str, str] | None:
                found = await versions()
                return found if len(found) == len(f.spec.nodes) else None

            old = await eventually(every_node)
            assert NEW_DRIVER not in old.values()
            seen_new: dict[str, str] = {}  # node -> its upgrade state when its slice first said the new version

            async def watch() -> None:
                while len(seen_new) < len(f.spec.nodes):
                    for node, version in (await versions()).items():
                        if version.startswith(NEW_DRIVER.split(".")[0]) and node not in seen_new:
                            info = await f.cluster.node(node)
                            assert info is not None
                            seen_new[node] = info.labels.get(UPGRADE_STATE_LABEL, "")
                    await asyncio.sleep(0.05)  # a poll of the slices: the states only move forward meanwhile

            watcher = asyncio.create_task(watch())
            policy = DriverPolicy(
                desired_version=NEW_DRIVER, auto_upgrade=True, max_parallel_upgrades=1, max_unavailable="1"
            )
            await ConfigStore(f.client, f.subjects).write("driver", policy, 0, "test")
            await eventually(lambda: f.upgraded(NEW_DRIVER), timeout=180, interval=0.2)
            await asyncio.wait_for(watcher, timeout=30)
            assert set(seen_new) == {n.name for n in f.spec.nodes}
            assert all(state in AFTER_THE_DRAIN for state in seen_new.values()), seen_new
            await f.talk(sessions, timeout=120)
            f.sessions_intact(sessions)
            drains = sorted(f.verdicts)
            assert len(drains) >= len(f.spec.nodes)
            await f.check(min_checkpoints=len(sessions), drains=drains)
        finally:
            for running in devices:
                await running.stop(grace=1)
