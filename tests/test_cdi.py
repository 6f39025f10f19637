"""The CDI spec as NVIDIA's container toolkit makes it: device nodes, the driver's libraries, firmware and tools
mounted from a driver root, the hooks that link and index the libraries, and the MIG capability nodes. The driver
roots here are real folders of empty files; the spec is checked whole."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from services.device import config as device_config
from services.device.cdi import (
    SPEC_FILE,
    DriverRoot,
    cdi_spec,
    find_driver_files,
    parse_mig_minors,
    spec_problems,
    write_cdi_spec,
)
from services.device.config import DeviceSettings, parse_plugin_config
from services.device.plugin import KubeletDevicePlugin
from services.device.service import DeviceService
from shared.contract.device import GpuDevice, MigInstance
from shared.contract.subjects import Subjects
from shared.host.runner import start_service
from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import Settings
from shared.sim.gpus import SimGpus
from shared.sim.spec import parse_spec
from shared.wiring import Wiring
from tests.helpers import eventually

VERSION = "550.54.15"
LIBS = (
    "libcuda.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libcudadebugger.so",
    "libnvidia-opencl.so",
    "libnvidia-allocator.so",
    "libnvidia-cfg.so",
    "libnvidia-gpucomp.so",
)
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
X86 = "usr/lib/x86_64-linux-gnu"
MIG_MINORS = """config 1
monitor 2
gpu0/gi1/access 12
gpu0/gi1/ci0/access 13
gpu0/gi1/ci1/access 14
gpu0/gi2/access 21
gpu0/gi2/ci0/access 22
gpu1/gi1/access 147
gpu1/gi1/ci0/access 148
"""
OPTIONS = ["ro", "nosuid", "nodev", "bind"]


def touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def driver_root(
    root: Path,
    *,
    libs: tuple[str, ...] = LIBS,
    folder: str = X86,
    hook: str | None = "nvidia-cdi-hook",
    mig_minors: str | None = MIG_MINORS,
    firmware: bool = True,
    binaries: tuple[str, ...] = BINARIES,
) -> Path:
    for lib in libs:
        touch(root / folder / f"{lib}.{VERSION}")
    for binary in binaries:
        touch(root / "usr/bin" / binary)
    if hook:
        touch(root / "usr/bin" / hook)
    if firmware:
        touch(root / f"lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin")
    if mig_minors is not None:
        touch(root / "proc/driver/nvidia-caps/mig-minors")
        (root / "proc/driver/nvidia-caps/mig-minors").write_text(mig_minors)
    return root


def gpu(index: int, *instances: MigInstance) -> GpuDevice:
    return GpuDevice(
        index=index,
        uuid=f"GPU-{index}",
        model="NVIDIA H100 80GB HBM3",
        mig_capable=bool(instances),
        mig_enabled=bool(instances),
        mig_instances=list(instances),
    )


def mount(path: str, host_root: str = "") -> dict[str, Any]:
    return {"hostPath": host_root + path, "containerPath": path, "options": OPTIONS}


def edits_by_name(spec: dict[str, Any]) -> dict[str, Any]:
    return {d["name"]: d["containerEdits"] for d in spec["devices"]}


# -- the common edits: libraries, firmware, tools, hooks -----------------------------------------------------------
def test_the_spec_mounts_the_driver_and_hooks_its_libraries(tmp_path: Path) -> None:
    """The GPU Operator's layout: the driver lives in /run/nvidia/driver on the host, mounted elsewhere here."""
    here = driver_root(tmp_path / "driver")
    driver = find_driver_files(DriverRoot(host=Path("/run/nvidia/driver"), here=here), VERSION)
    spec = cdi_spec([gpu(0)], driver)
    assert spec_problems(spec) == []
    lib = "/usr/lib/x86_64-linux-gnu"
    host = "/run/nvidia/driver"
    assert spec["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}, {"path": "/dev/nvidia-uvm-tools"}],
        "mounts": [
            mount(f"{lib}/libcuda.so.550.54.15", host),
            mount(f"{lib}/libnvidia-ml.so.550.54.15", host),
            mount(f"{lib}/libnvidia-ptxjitcompiler.so.550.54.15", host),
            mount(f"{lib}/libnvidia-nvvm.so.550.54.15", host),
            mount(f"{lib}/libcudadebugger.so.550.54.15", host),
            mount(f"{lib}/libnvidia-opencl.so.550.54.15", host),
            mount(f"{lib}/libnvidia-allocator.so.550.54.15", host),
            mount(f"{lib}/libnvidia-cfg.so.550.54.15", host),
            mount(f"{lib}/libnvidia-gpucomp.so.550.54.15", host),
            mount("/lib/firmware/nvidia/550.54.15", host),
            mount("/usr/bin/nvidia-smi", host),
            mount("/usr/bin/nvidia-debugdump", host),
            mount("/usr/bin/nvidia-persistenced", host),
            mount("/usr/bin/nvidia-cuda-mps-control", host),
            mount("/usr/bin/nvidia-cuda-mps-server", host),
        ],
        "hooks": [
            {
                "hookName": "createContainer",
                "path": "/run/nvidia/driver/usr/bin/nvidia-cdi-hook",
                "args": [
                    "nvidia-cdi-hook",
                    "create-symlinks",
                    "--link",
                    f"libcuda.so.550.54.15::{lib}/libcuda.so.1",
                    "--link",
                    f"libcuda.so.1::{lib}/libcuda.so",
                    "--link",
                    f"libnvidia-ml.so.550.54.15::{lib}/libnvidia-ml.so.1",
                    "--link",
                    f"libnvidia-ml.so.1::{lib}/libnvidia-ml.so",
                    "--link",
                    f"libnvidia-ptxjitcompiler.so.550.54.15::{lib}/libnvidia-ptxjitcompiler.so.1",
                    "--link",
                    f"libnvidia-ptxjitcompiler.so.1::{lib}/libnvidia-ptxjitcompiler.so",
                    "--link",
                    f"libnvidia-nvvm.so.550.54.15::{lib}/libnvidia-nvvm.so.4",
                    "--link",
                    f"libnvidia-nvvm.so.4::{lib}/libnvidia-nvvm.so",
                    "--link",
                    f"libcudadebugger.so.550.54.15::{lib}/libcudadebugger.so.1",
                    "--link",
                    f"libcudadebugger.so.1::{lib}/libcudadebugger.so",
                    "--link",
                    f"libnvidia-opencl.so.550.54.15::{lib}/libnvidia-opencl.so.1",
                    "--link",
                    f"libnvidia-opencl.so.1::{lib}/libnvidia-opencl.so",
                    "--link",
                    f"libnvidia-allocator.so.550.54.15::{lib}/libnvidia-allocator.so.1",
                    "--link",
                    f"libnvidia-allocator.so.1::{lib}/libnvidia-allocator.so",
                    "--link",
                    f"libnvidia-cfg.so.550.54.15::{lib}/libnvidia-cfg.so.1",
                    "--link",
                    f"libnvidia-cfg.so.1::{lib}/libnvidia-cfg.so",
                ],
            },
            {
                "hookName": "createContainer",
                "path": "/run/nvidia/driver/usr/bin/nvidia-cdi-hook",
                "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", lib],
            },
        ],
    }
    # The devices themselves are untouched by the driver's files.
    assert edits_by_name(spec) == {
        "GPU-0": {"deviceNodes": [{"path": "/dev/nvidia0"}]},
        "0": {"deviceNodes": [{"path": "/dev/nvidia0"}]},
        "all": {"deviceNodes": [{"path": "/dev/nvidia0"}]},
    }


def test_on_a_host_installed_driver_host_and_container_paths_are_the_same(tmp_path: Path) -> None:
    """Driver root ``/`` seen by the service at its own path (``GPUWARDEN_DRIVER_ROOT_MOUNT`` unset): a library in
    a RHEL-style /usr/lib64 and one in /usr/lib are each found where they are, and the ldcache covers both."""
    root = driver_root(tmp_path, libs=("libcuda.so",), folder="usr/lib64", binaries=(), firmware=False)
    touch(root / "usr/lib" / f"libnvidia-ml.so.{VERSION}")
    touch(root / X86 / "libnvidia-cfg.so.535.104.05")  # another version's file is never mounted
    driver = find_driver_files(DriverRoot(host=root, here=root), VERSION)
    assert [lib.path for lib in driver.libraries] == [
        f"/usr/lib64/libcuda.so.{VERSION}",
        f"/usr/lib/libnvidia-ml.so.{VERSION}",
    ]
    assert "libnvidia-cfg.so" in driver.missing_libraries
    common = cdi_spec([gpu(0)], driver)["containerEdits"]
    assert common["mounts"] == [
        mount(f"/usr/lib64/libcuda.so.{VERSION}", str(root)),
        mount(f"/usr/lib/libnvidia-ml.so.{VERSION}", str(root)),
    ]
    assert common["hooks"][0]["args"][2:] == [
        "--link",
        f"libcuda.so.{VERSION}::/usr/lib64/libcuda.so.1",
        "--link",
        "libcuda.so.1::/usr/lib64/libcuda.so",
        "--link",
        f"libnvidia-ml.so.{VERSION}::/usr/lib/libnvidia-ml.so.1",
        "--link",
        "libnvidia-ml.so.1::/usr/lib/libnvidia-ml.so",
    ]
    assert common["hooks"][1]["args"] == [
        "nvidia-cdi-hook",
        "update-ldcache",
        "--folder",
        "/usr/lib",
        "--folder",
        "/usr/lib64",
    ]


def test_aarch64_libraries_are_found(tmp_path: Path) -> None:
    root = driver_root(tmp_path, libs=("libcuda.so",), folder="usr/lib/aarch64-linux-gnu", hook=None)
    driver = find_driver_files(DriverRoot(host=Path("/"), here=root), VERSION)
    assert [lib.path for lib in driver.libraries] == [f"/usr/lib/aarch64-linux-gnu/libcuda.so.{VERSION}"]
    assert cdi_spec([gpu(0)], driver)["containerEdits"]["mounts"][0] == mount(
        f"/usr/lib/aarch64-linux-gnu/libcuda.so.{VERSION}"
    )


def test_the_legacy_nvidia_ctk_takes_its_hooks_as_a_subcommand(tmp_path: Path) -> None:
    root = driver_root(tmp_path, libs=("libcuda.so",), hook="nvidia-ctk")
    hooks = cdi_spec([gpu(0)], find_driver_files(DriverRoot(host=Path("/"), here=root), VERSION))["containerEdits"][
        "hooks"
    ]
    assert hooks == [
        {
            "hookName": "createContainer",
            "path": "/usr/bin/nvidia-ctk",
            "args": [
                "nvidia-ctk",
                "hook",
                "create-symlinks",
                "--link",
                f"libcuda.so.{VERSION}::/{X86}/libcuda.so.1",
                "--link",
                f"libcuda.so.1::/{X86}/libcuda.so",
            ],
        },
        {
            "hookName": "createContainer",
            "path": "/usr/bin/nvidia-ctk",
            "args": ["nvidia-ctk", "hook", "update-ldcache", "--folder", f"/{X86}"],
        },
    ]
    # Both present: the dedicated hook binary wins.
    touch(root / "usr/bin/nvidia-cdi-hook")
    assert find_driver_files(DriverRoot(here=root), VERSION).hook == ("/usr/bin/nvidia-cdi-hook", ("nvidia-cdi-hook",))


def test_a_library_whose_soname_is_its_own_file_gets_no_links(tmp_path: Path) -> None:
    root = driver_root(tmp_path, libs=("libnvidia-gpucomp.so",), binaries=(), firmware=False)
    hooks = cdi_spec([gpu(0)], find_driver_files(DriverRoot(here=root), VERSION))["containerEdits"]["hooks"]
    assert hooks == [
        {
            "hookName": "createContainer",
            "path": "/usr/bin/nvidia-cdi-hook",
            "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", f"/{X86}"],
        }
    ]


# -- what is absent is not listed ----------------------------------------------------------------------------------
def test_without_libraries_there_are_no_library_mounts_and_no_hooks(tmp_path: Path) -> None:
    root = driver_root(tmp_path, libs=())
    driver = find_driver_files(DriverRoot(here=root), VERSION)
    assert driver.libraries == () and driver.missing_libraries == LIBS and driver.hook is not None
    common = cdi_spec([gpu(0)], driver)["containerEdits"]
    assert "hooks" not in common
    assert [m["containerPath"] for m in common["mounts"]] == [
        f"/lib/firmware/nvidia/{VERSION}",
        *(f"/usr/bin/{b}" for b in BINARIES),
    ]


def test_an_empty_driver_root_gives_the_device_nodes_only(tmp_path: Path) -> None:
    driver = find_driver_files(DriverRoot(here=tmp_path), VERSION)
    spec = cdi_spec([gpu(0)], driver)
    assert spec == cdi_spec([gpu(0)])
    assert spec["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}, {"path": "/dev/nvidia-uvm-tools"}],
    }
    assert spec_problems(spec) == []


def test_an_unknown_driver_version_mounts_no_libraries_or_firmware(tmp_path: Path) -> None:
    driver = find_driver_files(DriverRoot(here=driver_root(tmp_path)), "")
    assert driver.libraries == () and driver.firmware is None
    assert [m["containerPath"] for m in cdi_spec([gpu(0)], driver)["containerEdits"]["mounts"]] == [
        f"/usr/bin/{b}" for b in BINARIES
    ]


def test_without_a_hook_binary_the_libraries_are_mounted_without_hooks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = driver_root(tmp_path / "root", hook=None)
    caplog.set_level(logging.INFO, logger="services.device.cdi")
    path = write_cdi_spec(tmp_path / "cdi", [gpu(0)], DriverRoot(here=root), VERSION)
    assert path is not None
    spec = json.loads(path.read_text())
    assert spec_problems(spec) == [] and "hooks" not in spec["containerEdits"]
    assert len(spec["containerEdits"]["mounts"]) == 15
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "CDI spec has no hooks: no nvidia-cdi-hook or nvidia-ctk in usr/bin under the driver root; containers get "
        "the libraries without their .so.1/.so links or an ldcache entry"
    ]


# -- MIG -----------------------------------------------------------------------------------------------------------
def test_mig_minors_are_read_and_odd_lines_skipped() -> None:
    text = "config 1\nmonitor 2\ngpu0/gi1/access 12\n\nnonsense\ngpu0/gi1/ci0/access x\n"
    assert parse_mig_minors(text) == {"config": 1, "monitor": 2, "gpu0/gi1/access": 12}


def mig_gpus() -> list[GpuDevice]:
    return [
        gpu(
            0,
            MigInstance(uuid="MIG-a", profile="1g.10gb", gpu_instance_id=1, compute_instance_id=0),
            MigInstance(uuid="MIG-b", profile="1g.10gb", gpu_instance_id=1, compute_instance_id=1),
            MigInstance(uuid="MIG-c", profile="3g.40gb", gpu_instance_id=2, compute_instance_id=0),
        ),
        gpu(1, MigInstance(uuid="MIG-d", profile="7g.80gb")),  # ids unknown
    ]


def test_a_mig_device_gets_its_gpu_and_compute_instance_capability_nodes(tmp_path: Path) -> None:
    driver = find_driver_files(DriverRoot(here=driver_root(tmp_path)), VERSION)
    spec = cdi_spec(mig_gpus(), driver)
    assert spec_problems(spec) == []

    def nodes(*paths: str) -> dict[str, Any]:
        return {"deviceNodes": [{"path": p} for p in paths]}

    cap = "/dev/nvidia-caps/nvidia-cap"
    assert edits_by_name(spec) == {
        "GPU-0": nodes("/dev/nvidia0"),
        "0": nodes("/dev/nvidia0"),
        "MIG-a": nodes("/dev/nvidia0", f"{cap}12", f"{cap}13"),
        "0:0": nodes("/dev/nvidia0", f"{cap}12", f"{cap}13"),
        "MIG-b": nodes("/dev/nvidia0", f"{cap}12", f"{cap}14"),
        "0:1": nodes("/dev/nvidia0", f"{cap}12", f"{cap}14"),
        "MIG-c": nodes("/dev/nvidia0", f"{cap}21", f"{cap}22"),
        "0:2": nodes("/dev/nvidia0", f"{cap}21", f"{cap}22"),
        "GPU-1": nodes("/dev/nvidia1"),
        "1": nodes("/dev/nvidia1"),
        "MIG-d": nodes("/dev/nvidia1"),  # no ids: only its GPU's node
        "1:0": nodes("/dev/nvidia1"),
        "all": nodes("/dev/nvidia0", f"{cap}12", f"{cap}13", f"{cap}14", f"{cap}21", f"{cap}22", "/dev/nvidia1"),
    }


def test_without_mig_minors_mig_devices_keep_their_gpu_node(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = driver_root(tmp_path / "root", mig_minors=None)
    caplog.set_level(logging.INFO, logger="services.device.cdi")
    path = write_cdi_spec(tmp_path / "cdi", mig_gpus(), DriverRoot(here=root), VERSION)
    assert path is not None
    by_name = edits_by_name(json.loads(path.read_text()))
    assert by_name["MIG-a"] == {"deviceNodes": [{"path": "/dev/nvidia0"}]}
    assert by_name["all"] == {"deviceNodes": [{"path": "/dev/nvidia0"}, {"path": "/dev/nvidia1"}]}
    assert any(
        r.getMessage().startswith("CDI spec: no proc/driver/nvidia-caps/mig-minors under the driver root")
        for r in caplog.records
    )


def test_mig_devices_missing_from_the_minors_are_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = driver_root(tmp_path / "root", mig_minors="gpu0/gi1/access 12\n")  # no compute instance lines
    caplog.set_level(logging.INFO, logger="services.device.cdi")
    write_cdi_spec(tmp_path / "cdi", mig_gpus(), DriverRoot(here=root), VERSION)
    [record] = [r for r in caplog.records if "capability minors are unknown" in r.getMessage()]
    assert record.__dict__["mig_devices"] == ["MIG-a", "MIG-b", "MIG-c", "MIG-d"]


# -- validation and writing ----------------------------------------------------------------------------------------
def test_hooks_and_mounts_are_validated() -> None:
    spec = {
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}],
        "containerEdits": {
            "mounts": [{"hostPath": "usr/lib/x", "containerPath": "/usr/lib/x", "options": ["ro", 1]}],
            "hooks": [
                {"hookName": "beforeStart", "path": "nvidia-cdi-hook", "args": ["a", 2]},
                {"hookName": "createContainer", "path": "/h", "env": ["NOEQUALS"], "timeout": 0},
                "hook",
            ],
        },
    }
    assert spec_problems(spec) == [
        "$.containerEdits.mounts[0].hostPath: expected an absolute path",
        "$.containerEdits.mounts[0].options: expected a list of strings",
        "$.containerEdits.hooks[0].hookName: 'beforeStart' is not one of createContainer, createRuntime, "
        "poststart, poststop, prestart, startContainer",
        "$.containerEdits.hooks[0].path: expected an absolute path",
        "$.containerEdits.hooks[0].args: expected a list of strings",
        "$.containerEdits.hooks[1].env: expected a list of 'NAME=value'",
        "$.containerEdits.hooks[1].timeout: expected a positive number of seconds",
        "$.containerEdits.hooks[2]: must be an object",
    ]


def test_the_spec_is_rewritten_only_when_the_driver_files_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = driver_root(tmp_path / "root", libs=("libcuda.so",))
    folder = tmp_path / "cdi"
    caplog.set_level(logging.INFO, logger="services.device.cdi")
    path = write_cdi_spec(folder, [gpu(0)], DriverRoot(here=root), VERSION)
    assert path is not None
    first = path.stat()
    assert write_cdi_spec(folder, [gpu(0)], DriverRoot(here=root), VERSION) == path
    assert path.stat().st_mtime_ns == first.st_mtime_ns and path.stat().st_ino == first.st_ino
    found = [r for r in caplog.records if r.getMessage() == "CDI spec: driver files found"]
    assert len(found) == 1  # said once, not at every write
    assert found[0].__dict__["libraries"] == [f"/{X86}/libcuda.so.{VERSION}"]
    assert "libnvidia-ml.so" in found[0].__dict__["missing_libraries"]

    # A restarted service finds its spec already written, and still says what it found.
    restarted = tmp_path / "cdi-restarted"
    restarted.mkdir()
    shutil.copy2(path, restarted / SPEC_FILE)
    before = (restarted / SPEC_FILE).stat()
    write_cdi_spec(restarted, [gpu(0)], DriverRoot(here=root), VERSION)
    assert (restarted / SPEC_FILE).stat().st_ino == before.st_ino
    assert len([r for r in caplog.records if r.getMessage() == "CDI spec: driver files found"]) == 2

    touch(root / X86 / f"libnvidia-ml.so.{VERSION}")
    write_cdi_spec(folder, [gpu(0)], DriverRoot(here=root), VERSION)
    assert path.stat().st_ino != first.st_ino
    mounted = [m["containerPath"] for m in json.loads(path.read_text())["containerEdits"]["mounts"]]
    assert f"/{X86}/libnvidia-ml.so.{VERSION}" in mounted


def test_a_driver_root_that_is_not_a_folder_finds_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert write_cdi_spec(tmp_path / "cdi", [gpu(0)], DriverRoot(here=blocker), VERSION) is not None
    spec = json.loads((tmp_path / "cdi" / SPEC_FILE).read_text())
    assert "mounts" not in spec["containerEdits"]


# -- settings ------------------------------------------------------------------------------------------------------
def test_the_driver_root_comes_from_the_environment() -> None:
    default = device_config.load({})
    assert default.driver_root == Path("/") and default.driver_root_here == Path("/")
    operator = device_config.load({"GPUWARDEN_DRIVER_ROOT": "/run/nvidia/driver"})
    assert operator.driver_root == operator.driver_root_here == Path("/run/nvidia/driver")
    mounted = device_config.load({"GPUWARDEN_DRIVER_ROOT": "/", "GPUWARDEN_DRIVER_ROOT_MOUNT": "/driver-root"})
    assert (mounted.driver_root, mounted.driver_root_here) == (Path("/"), Path("/driver-root"))
    with pytest.raises(SettingsError, match=r"GPUWARDEN_DRIVER_ROOT='run/nvidia/driver': expected an absolute path"):
        device_config.load({"GPUWARDEN_DRIVER_ROOT": "run/nvidia/driver"})
    with pytest.raises(SettingsError, match=r"GPUWARDEN_DRIVER_ROOT_MOUNT='driver-root': expected an absolute path"):
        device_config.load({"GPUWARDEN_DRIVER_ROOT_MOUNT": "driver-root"})


# -- through the plugin and the device service (plugin_dir: tests/conftest.py) -------------------------------------
async def test_the_plugin_keeps_the_driver_version_across_a_pause(tmp_path: Path, plugin_dir: Path) -> None:
    root = driver_root(tmp_path / "root", libs=("libcuda.so",))
    settings = DeviceSettings(
        plugin_dir=plugin_dir, plugin="on", cdi_dir=plugin_dir / "cdi", driver_root=Path("/"), driver_root_mount=root
    )
    plugin = KubeletDevicePlugin(settings)
    spec_path = plugin_dir / "cdi" / SPEC_FILE

    def mounted() -> list[str]:
        return [m["hostPath"] for m in json.loads(spec_path.read_text())["containerEdits"].get("mounts", [])]

    await plugin.update([gpu(0)], VERSION)
    assert f"/{X86}/libcuda.so.{VERSION}" in mounted()
    await plugin.pause()
    await plugin.resume()  # what the MIG controller does: the GPUs again, no version given
    assert f"/{X86}/libcuda.so.{VERSION}" in mounted() and plugin.describe()["cdi_error"] is None
    await plugin.update([gpu(0)], "560.35.03")  # a driver upgrade whose files are not there (yet)
    assert not any("libcuda" in m for m in mounted())


SIM_SPEC = """
driver_version: "550.54.15"
cuda_version: "12.4"
nodes:
  - name: node-1
    gpus:
      - {model: NVIDIA H100 80GB HBM3, memory_mib: 81559, count: 1, mig_profiles: ["1g.10gb", "3g.40gb"]}
      - {model: NVIDIA L4, memory_mib: 23034, count: 1, nvlink: false}
"""


async def test_the_device_service_writes_the_full_spec_from_the_configured_root(
    settings: Settings, subjects: Subjects, redis_client: aioredis.Redis, plugin_dir: Path, tmp_path: Path
) -> None:
    """The GPU Operator's layout, through the service: the driver version comes from the inventory, the files from
    the driver root's mount, the paths in the spec are the host's, and the simulated MIG instances' ids find their
    capability nodes."""
    root = driver_root(tmp_path / "driver-root")
    gpus = SimGpus(redis_client, subjects, parse_spec(SIM_SPEC, "spec.yaml"), "node-1")
    h100, l4 = (d.uuid for d in await gpus.devices())
    await gpus.set_mig_mode(h100, True)
    small = await gpus.create_mig_instance(h100, "1g.10gb")
    large = await gpus.create_mig_instance(h100, "3g.40gb")
    assert (small.gpu_instance_id, small.compute_instance_id, large.gpu_instance_id) == (1, 0, 2)
    device_settings = DeviceSettings(
        inventory_s=0.05,
        plugin_dir=plugin_dir,
        plugin="on",
        kubelet_poll_s=0.05,
        cdi_dir=plugin_dir / "cdi",
        plugin_config=parse_plugin_config("mig_strategy: mixed\ndevice_list_strategy: cdi\n"),
        driver_root=Path("/run/nvidia/driver"),
        driver_root_mount=root,
    )
    runner = await start_service(DeviceService(device_settings, gpus=gpus), settings, Wiring)
    try:
        spec_path = plugin_dir / "cdi" / SPEC_FILE
        await eventually(spec_path.is_file)
        spec = json.loads(spec_path.read_text())
    finally:
        await runner.stop(grace=1)
    assert spec_problems(spec) == []
    common = spec["containerEdits"]
    assert common["mounts"][0] == mount(f"/{X86}/libcuda.so.{VERSION}", "/run/nvidia/driver")
    assert len(common["mounts"]) == 15
    assert [h["path"] for h in common["hooks"]] == ["/run/nvidia/driver/usr/bin/nvidia-cdi-hook"] * 2
    by_name = edits_by_name(spec)
    cap = "/dev/nvidia-caps/nvidia-cap"
    assert by_name[small.uuid]["deviceNodes"] == [{"path": "/dev/nvidia0"}, {"path": f"{cap}12"}, {"path": f"{cap}13"}]
    assert by_name[large.uuid]["deviceNodes"] == [{"path": "/dev/nvidia0"}, {"path": f"{cap}21"}, {"path": f"{cap}22"}]
    assert by_name[l4]["deviceNodes"] == [{"path": "/dev/nvidia1"}]
