"""The device service's settings (environment) and the device plugin's configuration document (a file).

``DevicePluginConfig`` is what users of NVIDIA's device plugin write in its config file: the MIG strategy, sharing
by time-slicing and how Allocate names devices. Unknown keys are refused, like every configuration document here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml

from shared.plumbing.errors import SettingsError
from shared.plumbing.settings import (
    Parse,
    absolute_path,
    any_path,
    choice,
    documented,
    on_off,
    seconds,
    setting,
    settings_from_env,
)

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
PLUGIN_MODES: tuple[PluginMode, ...] = ("auto", "on", "off")
DeviceApi = Literal["plugin", "dra", "both"]
DEVICE_APIS: tuple[DeviceApi, ...] = ("plugin", "dra", "both")
DEFAULT_APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs that are the running program's fault, not the GPU's (NVIDIA's device plugin ignores the same six)."""


def _plugin_config_file(name: str, path: str) -> DevicePluginConfig:
    try:
        raw = Path(path).read_text()
    except OSError as exc:
        raise SettingsError(f"{name}={path!r}: cannot read it: {exc.strerror or exc}") from None
    return parse_plugin_config(raw, f"{name}={path}")


def parse_xids(raw: str, name: str = "GPUWARDEN_DEVICE_APPLICATION_XIDS") -> frozenset[int]:
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


PLUGIN_CONFIG_FILE: Parse[DevicePluginConfig] = Parse(_plugin_config_file, lambda _: "")
XIDS: Parse[frozenset[int]] = Parse(
    lambda name, raw: parse_xids(raw, name), lambda xids: ",".join(str(x) for x in sorted(xids)) or "none"
)


@dataclass(frozen=True)
class DeviceSettings:
    """``inventory_s``: how often the inventory is read again and re-published if it changed (MIG changes made by
    anyone, GPUs that vanished); health events re-publish it at once.

    ``plugin``: ``auto`` serves the kubelet device plugin when ``plugin_dir`` exists, ``on`` requires it, ``off``
    never serves it; ``api: dra`` serves only the DRA driver, whatever ``plugin`` says. ``kubelet_poll_s``: how
    often ``kubelet.sock`` (and the DRA driver's own sockets) are checked for a restarted kubelet.
    ``cdi_dir``: where the CDI spec of the node's GPUs is written while the plugin runs.

    ``driver_root``: the folder the driver is installed under, as the host sees it (``/``; a GPU Operator driver
    container's ``/run/nvidia/driver``); the CDI spec's library mounts and hooks name host paths under it, since
    the container runtime reads them on the host. ``driver_root_mount``: where this service finds that folder to
    look into it, when it is mounted elsewhere in its own container (NVIDIA's plugin calls it the container
    driver root)."""

    plugin_dir: Path = setting(
        "GPUWARDEN_DEVICE_PLUGIN_DIR",
        Path("/var/lib/kubelet/device-plugins"),
        "device: kubelet device plugin directory",
        parse=any_path(),
    )
    inventory_s: float = setting(
        "GPUWARDEN_DEVICE_INVENTORY_S", 10.0, "device: seconds between inventory re-reads", parse=seconds()
    )
    recovery_s: float = setting(
        "GPUWARDEN_DEVICE_RECOVERY_S",
        300.0,
        "device: an unhealthy GPU with no critical XID for this long is probed and, if it passes, offered again; "
        "0: never",
        parse=seconds(allow_zero=True),
    )
    """The quiet period after the last critical XID before a probe may return a GPU; 0: never."""
    plugin: PluginMode = setting(
        "GPUWARDEN_DEVICE_PLUGIN",
        "auto",
        "device: `auto` serves the device plugin when the plugin directory exists, `on` requires it, `off` never "
        "serves it",
        parse=choice(PLUGIN_MODES),
    )
    plugin_config: DevicePluginConfig = setting(
        "GPUWARDEN_DEVICE_PLUGIN_CONFIG",
        DevicePluginConfig(),
        "device: YAML/JSON file with `mig_strategy` (none/single/mixed), `device_list_strategy` (envvar/cdi),"
        " `sharing.time_slicing.resources[{name, replicas}]`",
        parse=PLUGIN_CONFIG_FILE,
    )
    api: DeviceApi = setting(
        "GPUWARDEN_DEVICE_API",
        "plugin",
        "device: how pods get GPUs: `plugin` the kubelet device plugin (as `GPUWARDEN_DEVICE_PLUGIN` says), `dra` "
        "the DRA driver `gpu.gpuwarden.io` (ResourceSlices and the kubelet DRA plugin), `both` side by side",
        parse=choice(DEVICE_APIS),
    )
    """Which of the device plugin and the DRA driver run (docs/devices.md)."""
    dra_plugin_dir: Path = setting(
        "GPUWARDEN_DRA_PLUGIN_DIR",
        Path("/var/lib/kubelet/plugins/gpu.gpuwarden.io"),
        "device: the folder of the DRA driver's `dra.sock`, which the kubelet dials",
        parse=any_path(),
    )
    dra_registry_dir: Path = setting(
        "GPUWARDEN_DRA_REGISTRY_DIR",
        Path("/var/lib/kubelet/plugins_registry"),
        "device: the kubelet's plugin registration folder, where the DRA driver offers its registration socket",
        parse=any_path(),
    )
    kubelet_poll_s: float = setting(
        "GPUWARDEN_KUBELET_POLL_S",
        1.0,
        "device: seconds between checks of `kubelet.sock` for a restarted kubelet (and of the DRA driver's sockets)",
        parse=seconds(),
    )
    cdi_dir: Path = setting(
        "GPUWARDEN_CDI_DIR",
        Path("/var/run/cdi"),
        "device: where the CDI spec of the node's GPUs (device plugin) and those of prepared DRA claims are written",
        parse=any_path(),
    )
    application_xids: frozenset[int] = setting(
        "GPUWARDEN_DEVICE_APPLICATION_XIDS",
        DEFAULT_APPLICATION_XIDS,
        "device: XIDs that are the application's fault and leave the GPU healthy, comma separated; `none`: every "
        "XID counts",
        parse=XIDS,
    )
    """XIDs the health rules ignore."""
    pod_resources_socket: Path = setting(
        "GPUWARDEN_DEVICE_POD_RESOURCES_SOCKET",
        Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        "device: the kubelet's PodResources API, asked which pods hold a failing GPU",
        parse=any_path(),
    )
    mig_step_timeout_s: float = setting(
        "GPUWARDEN_MIG_STEP_TIMEOUT_S",
        120.0,
        "device: one MIG change (mode, create, destroy) running longer fails the layout",
        parse=seconds(),
    )
    mig_reconcile_s: float = setting(
        "GPUWARDEN_MIG_RECONCILE_S",
        60.0,
        "device: seconds between MIG layout checks when nothing changed",
        parse=seconds(),
    )
    """The MIG controller compares layout and GPUs at least this often."""
    mig_retry_s: float = setting(
        "GPUWARDEN_MIG_RETRY_S",
        300.0,
        "device: a failed MIG layout is tried again after this, or at once when its document or label changes",
        parse=seconds(),
    )
    mig_checkpoint: bool = setting(
        "GPUWARDEN_MIG_CHECKPOINT",
        True,
        "device: `on` drains the node, saving every session's KV cache, before any MIG change; `off` for nodes "
        "without inference sessions",
        parse=on_off(),
    )
    mig_drain_timeout_s: float = setting(
        "GPUWARDEN_MIG_DRAIN_TIMEOUT_S",
        300.0,
        "device: no drain verdict within this fails the MIG layout with the GPUs unchanged; the savers get 80% of "
        "it, at most 25s",
        parse=seconds(),
    )
    driver_root: Path = setting(
        "GPUWARDEN_DRIVER_ROOT",
        Path("/"),
        "device: the folder the NVIDIA driver is installed under, as the host sees it (on GPU Operator nodes "
        "/run/nvidia/driver); the CDI spec mounts its libraries, firmware and tools and runs its `nvidia-cdi-hook` "
        "from there",
        parse=absolute_path(),
    )
    """Where the driver's files are on the host: the CDI spec's host paths."""
    driver_root_mount: Path | None = setting(
        "GPUWARDEN_DRIVER_ROOT_MOUNT",
        None,
        "device: where the device service's own container has `GPUWARDEN_DRIVER_ROOT` mounted, to look into it",
        parse=absolute_path(),
        shown="the same path",
    )
    """Where this service sees ``driver_root`` (its mount of it); None: the same."""

    @property
    def plugin_enabled(self) -> bool:
        if self.api == "dra":
            return False
        return self.plugin == "on" or (self.plugin == "auto" and self.plugin_dir.is_dir())

    @property
    def dra_enabled(self) -> bool:
        return self.api in ("dra", "both")

    @property
    def driver_root_here(self) -> Path:
        return self.driver_root if self.driver_root_mount is None else self.driver_root_mount


DOCUMENTED = documented(DeviceSettings)
"""Every variable this module's settings read, as docs/configuration.md lists it (tools.envdoc)."""


def load(env: Mapping[str, str] | None = None) -> DeviceSettings:
    settings = settings_from_env(DeviceSettings, env)
    if settings.plugin == "on" and settings.api != "dra" and not settings.plugin_dir.is_dir():
        raise SettingsError(
            f"GPUWARDEN_DEVICE_PLUGIN=on but GPUWARDEN_DEVICE_PLUGIN_DIR={str(settings.plugin_dir)!r} is not a "
            "folder (mount the kubelet's device-plugins folder there)"
        )
    return settings
