"""The device service's settings (environment) and the device plugin's configuration document (a file).

``DevicePluginConfig`` is what users of NVIDIA's device plugin write in its config file: the MIG strategy, sharing
by time-slicing and how Allocate names devices. Unknown keys are refused, like every configuration document here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml

from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import env_absolute_path, env_choice, env_on_off, env_seconds

MigStrategy = Literal["none", "single", "mixed"]
DeviceListStrategy = Literal["envvar", "cdi"]
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
MIG_PROFILE_PATTERN = r"[1-7]g\.[1-9][0-9]*gb(\+me)?"
RESOURCE_NAME_PATTERN = rf"^nvidia\.com/(gpu|mig-{MIG_PROFILE_PATTERN})$"
ResourceName = Annotated[
    str, msgspec.Meta(pattern=RESOURCE_NAME_PATTERN, description="'nvidia.com/gpu' or 'nvidia.com/mig-<profile>'")
]
Replicas = Annotated[int, msgspec.Meta(ge=2, le=1024, description="how many times each device is advertised")]


DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_DEVICE_PLUGIN_DIR": "device: kubelet device plugin directory (default /var/lib/kubelet/device-plugins/)",
    "GPUWARDEN_DEVICE_INVENTORY_S": "device: seconds between inventory re-reads (default 10)",
    "GPUWARDEN_DEVICE_RECOVERY_S": (
        "device: an unhealthy GPU with no critical XID for this long is probed and, if it passes, offered "
        "again (default 300; 0: never)"
    ),
    "GPUWARDEN_DEVICE_PLUGIN": (
        "device: `auto` (serve the device plugin when the plugin directory exists, default), `on` (required), `off`"
    ),
    "GPUWARDEN_DEVICE_PLUGIN_CONFIG": (
        "device: YAML/JSON file with `mig_strategy` (none/single/mixed), `device_list_strategy` (envvar/cdi),"
        " `sharing.time_slicing.resources[{name, replicas}]`"
    ),
    "GPUWARDEN_DEVICE_APPLICATION_XIDS": (
        "device: XIDs that are the application's fault and leave the GPU healthy, comma separated (default "
        "13,31,43,45,68,109; `none`: every XID counts)"
    ),
    "GPUWARDEN_MIG_STEP_TIMEOUT_S": (
        "device: one MIG change (mode, create, destroy) running longer fails the layout (default 120)"
    ),
    "GPUWARDEN_MIG_RECONCILE_S": "device: seconds between MIG layout checks when nothing changed (default 60)",
    "GPUWARDEN_MIG_RETRY_S": (
        "device: a failed MIG layout is tried again after this, or at once when its document or label changes"
        " (default 300)"
    ),
    "GPUWARDEN_MIG_CHECKPOINT": (
        "device: `on` (default) drains the node, saving every session's KV cache, before any MIG change; "
        "`off` for nodes without inference sessions"
    ),
    "GPUWARDEN_MIG_DRAIN_TIMEOUT_S": (
        "device: no drain verdict within this fails the MIG layout with the GPUs unchanged (default 300; the "
        "savers get 80% of it, at most 25s)"
    ),
    "GPUWARDEN_DEVICE_POD_RESOURCES_SOCKET": (
        "device: the kubelet's PodResources API, asked which pods hold a failing GPU (default "
        "/var/lib/kubelet/pod-resources/kubelet.sock)"
    ),
    "GPUWARDEN_CDI_DIR": (
        "device: where the CDI spec of the node's GPUs is written while the plugin runs (default /var/run/cdi)"
    ),
    "GPUWARDEN_DRIVER_ROOT": (
        "device: the folder the NVIDIA driver is installed under, as the host sees it; the CDI spec mounts "
        "its libraries, firmware and tools and runs its `nvidia-cdi-hook` from there (default /; GPU Operator"
        " nodes: /run/nvidia/driver)"
    ),
    "GPUWARDEN_DRIVER_ROOT_MOUNT": (
        "device: where the device service's own container has `GPUWARDEN_DRIVER_ROOT` mounted, to look into "
        "it (default: the same path)"
    ),
    "GPUWARDEN_KUBELET_POLL_S": "device: seconds between checks of `kubelet.sock` for a restarted kubelet (default 1)",
}
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


class ConfigError(SettingsError):
    """The device plugin's configuration is wrong; the message names the field (``$.sharing...``)."""


class TimeSlicedResource(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: ResourceName
    replicas: Replicas


class TimeSlicing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Each device of a listed resource is advertised ``replicas`` times as ``<uuid>::<k>``; no memory isolation."""

    resources: list[TimeSlicedResource] = msgspec.field(default_factory=list)


class Sharing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    time_slicing: TimeSlicing = msgspec.field(default_factory=TimeSlicing)


class DevicePluginConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``mig_strategy``: ``none`` advertises whole GPUs as ``nvidia.com/gpu``; ``single`` the MIG slices of the
    node's one profile as ``nvidia.com/gpu``; ``mixed`` one ``nvidia.com/mig-<profile>`` per profile (and GPUs not
    in MIG mode as ``nvidia.com/gpu``). ``device_list_strategy``: Allocate answers ``NVIDIA_VISIBLE_DEVICES`` or
    CDI device names (``nvidia.com/gpu=<uuid>``)."""

    mig_strategy: MigStrategy = "none"
    device_list_strategy: DeviceListStrategy = "envvar"
    sharing: Sharing = msgspec.field(default_factory=Sharing)

    def replicas(self, resource: str) -> int:
        for r in self.sharing.time_slicing.resources:
            if r.name == resource:
                return r.replicas
        return 1


def check_plugin_config(config: DevicePluginConfig) -> DevicePluginConfig:
    """What the types cannot say: a resource is time-sliced once, and ``nvidia.com/mig-*`` resources exist only
    under ``mig_strategy: mixed``."""
    seen: set[str] = set()
    for i, r in enumerate(config.sharing.time_slicing.resources):
        where = f"$.sharing.time_slicing.resources[{i}].name"
        if r.name in seen:
            raise ConfigError(f"{where}: {r.name!r} is listed twice")
        seen.add(r.name)
        if r.name.startswith(MIG_RESOURCE_PREFIX) and config.mig_strategy != "mixed":
            raise ConfigError(
                f"{where}: {r.name!r} is only advertised with mig_strategy: mixed "
                f"(mig_strategy is {config.mig_strategy!r}; use {GPU_RESOURCE!r})"
            )
    return config


_config_decoder = msgspec.json.Decoder(DevicePluginConfig)


def parse_plugin_config(raw: str | bytes, source: str = "device plugin config") -> DevicePluginConfig:
    """YAML or JSON; ``ConfigError`` naming ``source`` and the field. Nothing is applied from a refused document."""
    try:
        data = yaml.safe_load(raw) if raw else {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    try:
        config = msgspec.convert(data, DevicePluginConfig)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if "mig_strategy" in text:
            text += " (mig_strategy: none, single or mixed)"
        elif "device_list_strategy" in text:
            text += " (device_list_strategy: envvar or cdi)"
        raise ConfigError(f"{source}: {text}") from None
    try:
        return check_plugin_config(config)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


PluginMode = Literal["auto", "on", "off"]
APPLICATION_XIDS_ENV = "GPUWARDEN_DEVICE_APPLICATION_XIDS"
DEFAULT_APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs that are the running program's fault, not the GPU's (NVIDIA's device plugin ignores the same six)."""
POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


@dataclass(frozen=True)
class DeviceSettings:
    """``inventory_s``: how often the inventory is read again and re-published if it changed (MIG changes made by
    anyone, GPUs that vanished); health events re-publish it at once.

    ``plugin``: ``auto`` serves the kubelet device plugin when ``plugin_dir`` exists, ``on`` requires it, ``off``
    never serves it. ``kubelet_poll_s``: how often ``kubelet.sock`` is checked for a restarted kubelet.
    ``cdi_dir``: where the CDI spec of the node's GPUs is written while the plugin runs.

    ``driver_root``: the folder the driver is installed under, as the host sees it (``/``; a GPU Operator driver
    container's ``/run/nvidia/driver``); the CDI spec's library mounts and hooks name host paths under it, since
    the container runtime reads them on the host. ``driver_root_mount``: where this service finds that folder to
    look into it, when it is mounted elsewhere in its own container (NVIDIA's plugin calls it the container
    driver root)."""

    plugin_dir: Path = Path("/var/lib/kubelet/device-plugins/")
    inventory_s: float = 10.0
    recovery_s: float = 300.0  # quiet period after the last critical XID before a probe may return a GPU; 0: never
    plugin: PluginMode = "auto"
    plugin_config: DevicePluginConfig = field(default_factory=DevicePluginConfig)
    kubelet_poll_s: float = 1.0
    cdi_dir: Path = Path("/var/run/cdi")
    application_xids: frozenset[int] = DEFAULT_APPLICATION_XIDS  # XIDs the health rules ignore
    pod_resources_socket: Path = POD_RESOURCES_SOCKET  # the kubelet's PodResources API: which pod holds which GPU
    mig_step_timeout_s: float = 120.0  # one MIG change (mode, create, destroy) running longer fails the layout
    mig_reconcile_s: float = 60.0  # the MIG controller compares layout and GPUs at least this often
    mig_retry_s: float = 300.0  # a failed MIG layout is tried again after this, or when its document or label changes
    mig_checkpoint: bool = True  # drain the node (save every KV cache) before any MIG change; off: no inference here
    mig_drain_timeout_s: float = 300.0  # no drain verdict within this fails the MIG layout, GPUs unchanged
    driver_root: Path = Path("/")  # where the driver's files are on the host: the CDI spec's host paths
    driver_root_mount: Path | None = None  # where this service sees driver_root (its mount of it); None: the same

    @property
    def plugin_enabled(self) -> bool:
        return self.plugin == "on" or (self.plugin == "auto" and self.plugin_dir.is_dir())

    @property
    def driver_root_here(self) -> Path:
        return self.driver_root if self.driver_root_mount is None else self.driver_root_mount


def _plugin_mode(env: Mapping[str, str]) -> PluginMode:
    return env_choice(env, "GPUWARDEN_DEVICE_PLUGIN", ("auto", "on", "off"), "auto")  # type: ignore[return-value]


def _plugin_config(env: Mapping[str, str]) -> DevicePluginConfig:
    name = "GPUWARDEN_DEVICE_PLUGIN_CONFIG"
    path = env.get(name, "")
    if not path:
        return DevicePluginConfig()
    try:
        raw = Path(path).read_text()
    except OSError as exc:
        raise SettingsError(f"{name}={path!r}: cannot read it: {exc.strerror or exc}") from None
    return parse_plugin_config(raw, f"{name}={path}")


def parse_xids(raw: str, name: str = APPLICATION_XIDS_ENV) -> frozenset[int]:
    """``13,31,43``: comma-separated XID numbers; ``none`` for an empty list (every XID is critical)."""
    text = raw.strip()
    if text.lower() == "none":
        return frozenset()
    xids: set[int] = set()
    for part in text.split(","):
        item = part.strip()
        if not (item.isascii() and item.isdigit()) or int(item) == 0:
            raise SettingsError(
                f"{name}={raw!r}: {item!r} is not an XID; expected positive integers separated by commas "
                "(e.g. 13,31,43,45,68,109), or none"
            )
        xids.add(int(item))
    return frozenset(xids)


def load(env: Mapping[str, str] | None = None) -> DeviceSettings:
    env = os.environ if env is None else env
    plugin_dir = env.get("GPUWARDEN_DEVICE_PLUGIN_DIR", "/var/lib/kubelet/device-plugins/")
    if not plugin_dir.strip():
        raise SettingsError("GPUWARDEN_DEVICE_PLUGIN_DIR is empty: give the kubelet's device-plugins folder")
    mode = _plugin_mode(env)
    settings = DeviceSettings(
        plugin_dir=Path(plugin_dir),
        inventory_s=env_seconds(env, "GPUWARDEN_DEVICE_INVENTORY_S", 10.0),
        recovery_s=env_seconds(env, "GPUWARDEN_DEVICE_RECOVERY_S", 300.0, allow_zero=True),
        plugin=mode,
        plugin_config=_plugin_config(env),
        kubelet_poll_s=env_seconds(env, "GPUWARDEN_KUBELET_POLL_S", 1.0),
        cdi_dir=Path(env.get("GPUWARDEN_CDI_DIR", "") or "/var/run/cdi"),
        application_xids=(
            parse_xids(env[APPLICATION_XIDS_ENV])
            if env.get(APPLICATION_XIDS_ENV, "").strip()
            else DEFAULT_APPLICATION_XIDS
        ),
        pod_resources_socket=Path(env.get("GPUWARDEN_DEVICE_POD_RESOURCES_SOCKET", "") or POD_RESOURCES_SOCKET),
        mig_step_timeout_s=env_seconds(env, "GPUWARDEN_MIG_STEP_TIMEOUT_S", 120.0),
        mig_reconcile_s=env_seconds(env, "GPUWARDEN_MIG_RECONCILE_S", 60.0),
        mig_retry_s=env_seconds(env, "GPUWARDEN_MIG_RETRY_S", 300.0),
        mig_checkpoint=env_on_off(env, "GPUWARDEN_MIG_CHECKPOINT", True),
        mig_drain_timeout_s=env_seconds(env, "GPUWARDEN_MIG_DRAIN_TIMEOUT_S", 300.0),
        driver_root=env_absolute_path(env, "GPUWARDEN_DRIVER_ROOT", "/"),
        driver_root_mount=(
            env_absolute_path(env, "GPUWARDEN_DRIVER_ROOT_MOUNT", "/")
            if env.get("GPUWARDEN_DRIVER_ROOT_MOUNT", "").strip()
            else None
        ),
    )
    if mode == "on" and not settings.plugin_dir.is_dir():
        raise SettingsError(
            f"GPUWARDEN_DEVICE_PLUGIN=on but GPUWARDEN_DEVICE_PLUGIN_DIR={plugin_dir!r} is not a folder "
            "(mount the kubelet's device-plugins folder there)"
        )
    return settings
