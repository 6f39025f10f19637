"""Every event type, the tagged union of them, and the one encoder/decoder pair built from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import msgspec

from shared.contract.base import Event
from shared.contract.checkpoint import (
    AgentSessions,
    AnnouncementAck,
    CheckpointFailed,
    CheckpointForgotten,
    CheckpointLocation,
    CheckpointSaved,
    LocateCheckpoint,
    SaveProgress,
    SaveSessions,
    SaveSessionsReport,
    SessionRestored,
)
from shared.contract.config import ConfigApplied
from shared.contract.deadletter import DeadLetter
from shared.contract.device import DeviceHealthChanged, DeviceInventory, GpuXid, MigConfigChanged
from shared.contract.driver import (
    DriverAgentAnswer,
    DriverInstalled,
    DriverInstallFailed,
    DriverUpgradeStateChanged,
    InstallDriver,
    ReadDriverVersions,
    ValidateDriver,
)
from shared.contract.load import PodLoad
from shared.contract.metrics import DeploymentUtilisation, GpuSample
from shared.contract.models import ModelPrepared, PrepareModel, RolloutState, ServingQuery
from shared.contract.node import (
    DrainCompleted,
    DrainFailed,
    DrainQuery,
    DrainRecord,
    DrainRequested,
    NodeCordoned,
    NodeUncordoned,
)
from shared.contract.requests import InferenceRequest
from shared.contract.scaler import ScaleDecision
from shared.contract.sessions import (
    FleetQuery,
    FleetSummary,
    PrefetchSessions,
    SessionLocation,
    SessionsPage,
    SessionsPrefetched,
    SessionsQuery,
    WhereIsSession,
)

EVENT_TYPES: tuple[type[Event], ...] = (
    DrainRequested,
    DrainCompleted,
    DrainFailed,
    DrainQuery,
    DrainRecord,
    NodeCordoned,
    NodeUncordoned,
    DriverUpgradeStateChanged,
    DriverInstalled,
    DriverInstallFailed,
    InstallDriver,
    ValidateDriver,
    ReadDriverVersions,
    DriverAgentAnswer,
    DeviceInventory,
    DeviceHealthChanged,
    GpuXid,
    MigConfigChanged,
    GpuSample,
    DeploymentUtilisation,
    ScaleDecision,
    CheckpointSaved,
    CheckpointFailed,
    CheckpointForgotten,
    SessionRestored,
    SaveSessions,
    SaveSessionsReport,
    SaveProgress,
    AgentSessions,
    AnnouncementAck,
    LocateCheckpoint,
    CheckpointLocation,
    SessionLocation,
    WhereIsSession,
    PrefetchSessions,
    SessionsPrefetched,
    SessionsQuery,
    SessionsPage,
    FleetQuery,
    FleetSummary,
    PodLoad,
    PrepareModel,
    ModelPrepared,
    ServingQuery,
    RolloutState,
    ConfigApplied,
    InferenceRequest,
    DeadLetter,
)

AnyEvent = Union[EVENT_TYPES]  # type: ignore[valid-type]  # noqa: UP007

BY_KIND: dict[str, type[Event]] = {t.__struct_config__.tag: t for t in EVENT_TYPES}  # type: ignore[misc]

FAMILIES: dict[str, tuple[type[Event], ...]] = {}
for _t in EVENT_TYPES:
    FAMILIES.setdefault(_t.family, ())
    FAMILIES[_t.family] = (*FAMILIES[_t.family], _t)


class EventCodec:
    """Encodes any event and decodes bytes into the right Struct, or raises ``msgspec.DecodeError``/``ValidationError``.

    Built once per process; msgspec's encoders and decoders are reusable and thread-safe.
    """

    def __init__(self) -> None:
        self._encoder = msgspec.json.Encoder()
        self._decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(AnyEvent)
        self.encode: Callable[[Event], bytes] = self._encoder.encode  # the encoder's own method: no wrapper call

    def decode(self, data: bytes) -> Event:
        event = self._decoder.decode(data)
        assert isinstance(event, Event)
        return event


codec = EventCodec()
