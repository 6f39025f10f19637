"""What the node's GPUs are advertised as (MIG strategies, time-slicing), the plugin's configuration document, the
choices of GetPreferredAllocation and the answers of Allocate, and the CDI spec: the pure parts of the device
plugin, without gRPC."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.device import config as device_config
from services.device.cdi import SPEC_FILE, CdiError, cdi_spec, spec_problems, write_cdi_spec
from services.device.config import ConfigError, DevicePluginConfig, parse_plugin_config
from services.device.resources import (
    AdvertisedDevice,
    Advertisement,
    AllocationError,
    ResourceError,
    advertise,
    affinity,
    allocate,
    preferred,
)
from shared.contract.device import GpuDevice, MigInstance
from shared.plumbing.errors import SettingsError


def gpu(
    index: int,
    numa: int | None = 0,
    peers: tuple[int, ...] = (),
    healthy: bool = True,
    instances: tuple[MigInstance, ...] | None = None,
) -> GpuDevice:
    return GpuDevice(
        index=index,
        uuid=f"GPU-{index}",
        model="NVIDIA H100 80GB HBM3",
        numa_node=numa,
        nvlink_peers=[f"GPU-{p}" for p in peers],
        healthy=healthy,
        mig_capable=instances is not None,
        mig_enabled=instances is not None,
        mig_instances=list(instances or ()),
    )


def mig(index: int, *profiles: str, healthy: bool = True) -> GpuDevice:
    instances = tuple(MigInstance(uuid=f"MIG-{index}-{k}", profile=p) for k, p in enumerate(profiles))
    return gpu(index, healthy=healthy, instances=instances)


def ids(advertised: Advertisement) -> dict[str, list[str]]:
    return {name: [d.id for d in devices] for name, devices in advertised.items()}


def config(text: str) -> DevicePluginConfig:
    return parse_plugin_config(text, "test.yaml")


# -- MIG strategies and time-slicing ------------------------------------------------------------------------------
def test_strategy_none_advertises_whole_gpus_even_in_mig_mode() -> None:
    gpus = [gpu(1), mig(0, "1g.10gb")]
    assert ids(advertise(gpus, DevicePluginConfig())) == {"nvidia.com/gpu": ["GPU-0", "GPU-1"]}


def test_strategy_single_advertises_the_one_profile_as_gpus() -> None:
    gpus = [mig(0, "1g.10gb", "1g.10gb"), mig(1, "1g.10gb")]
    advertised = advertise(gpus, config("mig_strategy: single"))
    assert ids(advertised) == {"nvidia.com/gpu": ["MIG-0-0", "MIG-0-1", "MIG-1-0"]}
    assert {d.gpu_uuid for d in advertised["nvidia.com/gpu"]} == {"GPU-0", "GPU-1"}
    assert ids(advertise([gpu(0), gpu(1)], config("mig_strategy: single"))) == {"nvidia.com/gpu": ["GPU-0", "GPU-1"]}


def test_strategy_single_refuses_a_node_it_cannot_describe() -> None:
    with pytest.raises(ResourceError, match=r"one MIG profile on the node; found 1g\.10gb, 3g\.40gb .*mixed"):
        advertise([mig(0, "1g.10gb", "3g.40gb")], config("mig_strategy: single"))
    with pytest.raises(ResourceError, match=r"GPU\(s\) 1 are not in MIG mode while GPU\(s\) 0 are"):
        advertise([mig(0, "1g.10gb"), gpu(1)], config("mig_strategy: single"))


def test_strategy_mixed_advertises_one_resource_per_profile() -> None:
    gpus = [mig(0, "3g.40gb", "1g.10gb", "1g.10gb"), gpu(1), mig(2, "1g.10gb", healthy=False)]
    advertised = advertise(gpus, config("mig_strategy: mixed"))
    assert ids(advertised) == {
        "nvidia.com/gpu": ["GPU-1"],
        "nvidia.com/mig-1g.10gb": ["MIG-0-1", "MIG-0-2", "MIG-2-0"],
        "nvidia.com/mig-3g.40gb": ["MIG-0-0"],
    }
    # A MIG instance is as healthy as its GPU.
    assert [d.health for d in advertised["nvidia.com/mig-1g.10gb"]] == ["Healthy", "Healthy", "Unhealthy"]


def test_time_slicing_advertises_each_device_replicas_times() -> None:
    text = """
mig_strategy: mixed
sharing:
  time_slicing:
    resources:
      - {name: nvidia.com/gpu, replicas: 3}
      - {name: nvidia.com/mig-1g.10gb, replicas: 2}
"""
    advertised = advertise([gpu(0, healthy=False), mig(1, "1g.10gb", "3g.40gb")], config(text))
    assert ids(advertised) == {
        "nvidia.com/gpu": ["GPU-0::0", "GPU-0::1", "GPU-0::2"],
        "nvidia.com/mig-1g.10gb": ["MIG-1-0::0", "MIG-1-0::1"],
        "nvidia.com/mig-3g.40gb": ["MIG-1-1"],
    }
    assert {d.health for d in advertised["nvidia.com/gpu"]} == {"Unhealthy"}
    assert [d.replica for d in advertised["nvidia.com/gpu"]] == [0, 1, 2]


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("mig_strategy: half", "`$.mig_strategy` (mig_strategy: none, single or mixed)"),
        ("device_list_strategy: volume", "`$.device_list_strategy` (device_list_strategy: envvar or cdi)"),
        ("mig-strategy: mixed", "unknown field `mig-strategy`"),
        ("sharing: {time_slicing: {resources: [{name: nvidia.com/gpu, replicas: 1}]}}", "`$.sharing.time_slicing"),
        ("sharing: {time_slicing: {resources: [{name: amd.com/gpu, replicas: 2}]}}", "resources[0].name`"),
        ("sharing: {time_slicing: {resources: [{name: nvidia.com/gpu}]}}", "missing required field `replicas`"),
        (
            "sharing: {time_slicing: {resources: [{name: nvidia.com/gpu, replicas: 2}, "
            "{name: nvidia.com/gpu, replicas: 4}]}}",
            "$.sharing.time_slicing.resources[1].name: 'nvidia.com/gpu' is listed twice",
        ),
        (
            "sharing: {time_slicing: {resources: [{name: nvidia.com/mig-1g.10gb, replicas: 2}]}}",
            "only advertised with mig_strategy: mixed (mig_strategy is 'none'",
        ),
        ("mig_strategy: [", "not valid YAML"),
    ],
)
def test_a_bad_plugin_config_is_refused_naming_the_field(text: str, names: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_plugin_config(text, "plugin.yaml")
    assert str(caught.value).startswith("plugin.yaml: ") and names in str(caught.value)


def test_settings_read_the_plugin_config_file(tmp_path: Path) -> None:
    path = tmp_path / "plugin.yaml"
    path.write_text("mig_strategy: mixed\ndevice_list_strategy: cdi\n")
    env = {"GPUWARDEN_DEVICE_PLUGIN_CONFIG": str(path), "GPUWARDEN_DEVICE_PLUGIN_DIR": str(tmp_path)}
    settings = device_config.load(env)
    assert settings.plugin_config.mig_strategy == "mixed" and settings.plugin_config.device_list_strategy == "cdi"
    assert settings.plugin_enabled and settings.cdi_dir == Path("/var/run/cdi")
    assert not device_config.load({**env, "GPUWARDEN_DEVICE_PLUGIN": "off"}).plugin_enabled
    assert not device_config.load({"GPUWARDEN_DEVICE_PLUGIN_DIR": str(tmp_path / "nope")}).plugin_enabled
    path.write_text("mig_strategy: some\n")
    with pytest.raises(SettingsError, match=rf"GPUWARDEN_DEVICE_PLUGIN_CONFIG={path}: .*`\$\.mig_strategy`"):
        device_config.load(env)
    with pytest.raises(SettingsError, match=r"GPUWARDEN_DEVICE_PLUGIN_CONFIG=.*cannot read it"):
        device_config.load({"GPUWARDEN_DEVICE_PLUGIN_CONFIG": str(tmp_path / "missing.yaml")})
    with pytest.raises(SettingsError, match=r"GPUWARDEN_DEVICE_PLUGIN=on but .* is not a folder"):
        device_config.load({"GPUWARDEN_DEVICE_PLUGIN": "on", "GPUWARDEN_DEVICE_PLUGIN_DIR": str(tmp_path / "x")})
    with pytest.raises(SettingsError, match="expected one of auto, on, off"):
        device_config.load({"GPUWARDEN_DEVICE_PLUGIN": "maybe"})


# -- preferred allocation -----------------------------------------------------------------------------------------
# GPUs 0-1 and 2-3 are NVLink pairs; 0, 1 and 4 sit on NUMA node 0, 2 and 3 on node 1.
TOPOLOGY = [gpu(0, 0, (1,)), gpu(1, 0, (0,)), gpu(2, 1, (3,)), gpu(3, 1, (2,)), gpu(4, 0)]


def by_id(gpus: list[GpuDevice], text: str = "") -> dict[str, AdvertisedDevice]:
    return {d.id: d for devices in advertise(gpus, config(text)).values() for d in devices}


def test_preferred_allocation_prefers_nvlink_then_numa() -> None:
    devices = by_id(TOPOLOGY)
    every = list(devices)
    assert preferred(devices, every, [], 2) == ["GPU-0", "GPU-1"]
    assert preferred(devices, every, ["GPU-3"], 2) == ["GPU-2", "GPU-3"]
    assert preferred(devices, ["GPU-0", "GPU-2", "GPU-3", "GPU-4"], [], 2) == ["GPU-2", "GPU-3"]
    # No NVLink partner left: the one on the same NUMA node.
    assert preferred(devices, ["GPU-1", "GPU-2", "GPU-4"], ["GPU-1"], 2) == ["GPU-1", "GPU-4"]
    assert preferred(devices, every, [], 3) == ["GPU-0", "GPU-1", "GPU-4"]


def test_preferred_allocation_spreads_time_slices_over_gpus() -> None:
    devices = by_id(TOPOLOGY[:2], "sharing: {time_slicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}")
    assert preferred(devices, list(devices), [], 2) == ["GPU-0::0", "GPU-1::0"]


def test_preferred_allocation_refuses_what_it_cannot_do() -> None:
    devices = by_id(TOPOLOGY)
    with pytest.raises(AllocationError, match=r"unknown device ID.*: GPU-9"):
        preferred(devices, ["GPU-0", "GPU-9"], [], 1)
    with pytest.raises(AllocationError, match=r"must-include device ID.*not among the available ones: GPU-2"):
        preferred(devices, ["GPU-0", "GPU-1"], ["GPU-2"], 1)
    with pytest.raises(AllocationError, match="cannot choose 3 device"):
        preferred(devices, ["GPU-0", "GPU-1"], [], 3)


@given(
    available=st.sets(st.integers(0, 4), min_size=1),
    size=st.integers(1, 5),
    data=st.data(),
)
def test_preferred_allocation_is_a_valid_deterministic_choice(
    available: set[int], size: int, data: st.DataObject
) -> None:
    devices = by_id(TOPOLOGY)
    pool = [f"GPU-{i}" for i in sorted(available)]
    must = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=min(size, len(pool))))
    if size > len(pool):
        with pytest.raises(AllocationError):
            preferred(devices, pool, must, size)
        return
    chosen = preferred(devices, pool, must, size)
    assert len(chosen) == size == len(set(chosen)) and set(must) <= set(chosen) <= set(pool)
    assert preferred(devices, list(reversed(pool)), list(reversed(must)), size) == chosen


def test_affinity_orders_slices_links_and_numa() -> None:
    d = by_id([*TOPOLOGY[:3], mig(5, "1g.10gb", "1g.10gb")], "mig_strategy: mixed")
    assert affinity(d["MIG-5-0"], d["MIG-5-1"]) == 3
    assert affinity(d["GPU-0"], d["GPU-1"]) == 3
    assert affinity(d["GPU-0"], d["GPU-2"]) == 0


# -- allocate -----------------------------------------------------------------------------------------------------
def test_allocate_answers_visible_devices_or_cdi_names() -> None:
    devices = by_id([gpu(0), gpu(1)])
    [a, b] = allocate(devices, [["GPU-1", "GPU-0"], ["GPU-0"]], "envvar")
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-1,GPU-0"} and a.cdi_devices == ()
    assert b.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-0"}
    [c] = allocate(devices, [["GPU-0", "GPU-1"]], "cdi")
    assert c.cdi_devices == ("nvidia.com/gpu=GPU-0", "nvidia.com/gpu=GPU-1") and c.envs == {}
    shared = by_id([gpu(0)], "sharing: {time_slicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}")
    [s] = allocate(shared, [["GPU-0::1", "GPU-0::0"]], "envvar")
    assert s.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-0"}


def test_allocate_refuses_unknown_repeated_and_unhealthy_ids() -> None:
    devices = by_id([gpu(0), gpu(1, healthy=False)])
    with pytest.raises(AllocationError, match=r"unknown device ID\(s\) for nvidia.com/gpu: GPU-7 \(advertised: GPU-0"):
        allocate(devices, [["GPU-0", "GPU-7"]], "envvar")
    with pytest.raises(AllocationError, match=r"container request 1: .* Unhealthy: GPU-1"):
        allocate(devices, [["GPU-0"], ["GPU-1"]], "envvar")
    with pytest.raises(AllocationError, match="asked for twice: GPU-0"):
        allocate(devices, [["GPU-0", "GPU-0"]], "envvar")
    with pytest.raises(AllocationError, match="no device IDs"):
        allocate(devices, [[]], "envvar")


# -- CDI ----------------------------------------------------------------------------------------------------------
def test_cdi_spec_is_valid_and_names_every_device() -> None:
    spec = cdi_spec([gpu(1), mig(0, "1g.10gb", "3g.40gb")])
    assert spec_problems(spec) == []
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == "nvidia.com/gpu"
    names = [d["name"] for d in spec["devices"]]
    assert names == ["GPU-0", "0", "MIG-0-0", "0:0", "MIG-0-1", "0:1", "GPU-1", "1", "all"]
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    assert by_name["GPU-1"]["deviceNodes"] == [{"path": "/dev/nvidia1"}]
    assert by_name["all"]["deviceNodes"] == [{"path": "/dev/nvidia0"}, {"path": "/dev/nvidia1"}]
    assert {"path": "/dev/nvidiactl"} in spec["containerEdits"]["deviceNodes"]


def test_cdi_validation_finds_what_is_wrong() -> None:
    bad = {
        "cdiVersion": "1",
        "kind": "gpu",
        "devices": [
            {"name": "a b", "containerEdits": {"deviceNodes": [{"path": "dev/x"}]}},
            {"name": "x", "containerEdits": {}},
            {"name": "x", "containerEdits": {"env": ["NOEQUALS"], "colour": 1}},
        ],
    }
    problems = spec_problems(bad)
    assert "$.cdiVersion: '1' is not a CDI version such as '0.6.0'" in problems
    assert "$.kind: 'gpu' is not 'vendor/class'" in problems
    assert "$.devices[0].name: 'a b' is not a CDI device name" in problems
    assert "$.devices[0].deviceNodes[0].path: expected an absolute path" in problems
    assert "$.devices[1]: has no edits" in problems
    assert "$.devices[2].name: 'x' is used twice" in problems
    assert "$.devices[2].env[0]: expected 'NAME=value'" in problems
    assert "$.devices[2].colour: unknown edit" in problems
    assert spec_problems({"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu", "devices": []}) == [
        "$.devices: must be a non-empty list"
    ]


def test_cdi_spec_is_written_atomically_and_only_when_changed(tmp_path: Path) -> None:
    folder = tmp_path / "cdi"
    path = write_cdi_spec(folder, [gpu(0)])
    assert path == folder / SPEC_FILE and spec_problems(json.loads(path.read_text())) == []
    first = path.stat()
    assert write_cdi_spec(folder, [gpu(0)]) == path and path.stat().st_mtime_ns == first.st_mtime_ns
    write_cdi_spec(folder, [gpu(0), gpu(1)])
    assert path.stat().st_ino != first.st_ino  # replaced by rename, never rewritten in place
    assert len(json.loads(path.read_text())["devices"]) == 5
    assert sorted(os.listdir(folder)) == [SPEC_FILE]  # no temporary file left behind
    assert write_cdi_spec(folder, []) is None and not path.exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CdiError, match=r"cannot write the CDI spec into .*file/sub \(GPUWARDEN_CDI_DIR\)"):
        write_cdi_spec(blocker / "sub", [gpu(0)])
