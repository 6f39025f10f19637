"""Model rollouts in the ``models`` configuration document: begin one, settle it (switched or aborted), read
where one stands. Every change is a compare-and-set of the whole document, retried on a lost race after reading
it again, so of two rollouts of one deployment begun at once exactly one is written: the other, reading again,
finds it in progress and is refused with a reason.

Only the checkpoint service settles a rollout (it coordinates the prepare and the switch); anyone with write
access to the configuration may begin one (``gpuwarden rollout``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Literal

import msgspec

from shared.contract.configdocs import DeploymentModel, ModelRollout, ModelVersions
from shared.contract.models import RolloutState
from shared.plumbing.configsync import ConfigStore
from shared.plumbing.errors import ConfigConflict

DOCUMENT = "models"
CAS_ATTEMPTS = 20


class RolloutRefused(Exception):
    """The rollout cannot begin; the message says why (one already in progress, nothing to change)."""


def deployment_key(namespace: str, deployment: str) -> str:
    return f"{namespace}/{deployment}"


async def read_models(store: ConfigStore) -> tuple[int, ModelVersions]:
    found = await store.read(DOCUMENT)
    if found is None:
        return 0, ModelVersions()
    assert isinstance(found.doc, ModelVersions)
    return found.version, found.doc


async def _change(
    store: ConfigStore, key: str, change: Callable[[DeploymentModel], DeploymentModel | None], by: str
) -> tuple[int, DeploymentModel] | None:
    """Apply ``change`` to the deployment's entry with compare-and-set, reading again after each lost race.
    Returns the document's new version and the entry; None when ``change`` wrote nothing (it returned None)."""
    for _ in range(CAS_ATTEMPTS):
        version, doc = await read_models(store)
        updated = change(doc.deployments.get(key, DeploymentModel()))
        if updated is None:
            return None
        try:
            written = await store.write(
                DOCUMENT, ModelVersions(deployments={**doc.deployments, key: updated}), version, by
            )
        except ConfigConflict:
            continue
        return written, updated
    raise ConfigConflict(DOCUMENT, -1, -1)


async def begin_rollout(
    store: ConfigStore,
    namespace: str,
    deployment: str,
    to_version: str,
    *,
    from_version: str = "",
    pinned_sessions: Literal["finish", "end"] = "finish",
    end_reason: str = "",
    prepare_timeout_s: float = 120.0,
    min_ready: float = 1.0,
    by: str = "",
    now: float | None = None,
) -> ModelRollout:
    """Write a new rollout of the deployment (phase ``preparing``) and return it. Raises ``RolloutRefused`` when
    one is in progress, when the deployment already serves ``to_version``, or when its current version is
    unknown and ``from_version`` was not given; ``InvalidConfig`` for options that do not validate."""
    key = deployment_key(namespace, deployment)
    began: list[ModelRollout] = []

    def change(entry: DeploymentModel) -> DeploymentModel | None:
        current = entry.rollout
        if current is not None and current.phase == "preparing":
            raise RolloutRefused(
                f"{key}: rollout {current.rollout_id} from {current.from_version} to {current.to_version} "
                f"is in progress (begun by {current.started_by or 'someone'}); wait for it to switch or abort"
            )
        serving = entry.serving_version or from_version
        if not serving:
            raise RolloutRefused(f"{key}: its serving version is not recorded yet; name it with --from")
        if from_version and entry.serving_version and from_version != entry.serving_version:
            raise RolloutRefused(f"{key}: serves {entry.serving_version!r}, not {from_version!r}")
        if serving == to_version:
            raise RolloutRefused(f"{key}: already serves {to_version!r}")
        options: dict[str, object] = {}
        if end_reason:
            options["end_reason"] = end_reason
        try:
            rollout = ModelRollout(
                rollout_id=uuid.uuid4().hex[:12],
                from_version=serving,
                to_version=to_version,
                pinned_sessions=pinned_sessions,
                prepare_timeout_s=prepare_timeout_s,
                min_ready=min_ready,
                started_at=time.time() if now is None else now,
                started_by=by,
                **options,  # type: ignore[arg-type]
            )
        except (ValueError, TypeError) as exc:
            raise RolloutRefused(f"{key}: {exc}") from None
        began[:] = [rollout]
        return DeploymentModel(serving_version=serving, rollout=rollout)

    await _change(store, key, change, by)
    return began[0]


async def settle_rollout(
    store: ConfigStore,
    namespace: str,
    deployment: str,
    rollout_id: str,
    phase: Literal["switched", "aborted"],
    *,
    reason: str = "",
    ready: list[str] | None = None,
    failed: list[str] | None = None,
    by: str = "",
    now: float | None = None,
) -> tuple[int, DeploymentModel] | None:
    """End the rollout ``rollout_id`` if it is still preparing: ``switched`` flips the serving version to its
    ``to_version`` in the same compare-and-set; ``aborted`` leaves the serving version as it was. Returns the
    document's new version and the deployment's new entry, or None when the rollout was already settled (or
    replaced): idempotent."""

    def change(entry: DeploymentModel) -> DeploymentModel | None:
        rollout = entry.rollout
        if rollout is None or rollout.rollout_id != rollout_id or rollout.phase != "preparing":
            return None
        settled = msgspec.structs.replace(
            rollout,
            phase=phase,
            reason=reason,
            ready=sorted(ready or []),
            failed=sorted(failed or []),
            finished_at=time.time() if now is None else now,
        )
        serving = rollout.to_version if phase == "switched" else entry.serving_version
        return DeploymentModel(serving_version=serving, rollout=settled)

    return await _change(store, deployment_key(namespace, deployment), change, by)


async def current_state(store: ConfigStore, namespace: str, deployment: str) -> RolloutState:
    version, doc = await read_models(store)
    return rollout_state(namespace, deployment, doc.deployments.get(deployment_key(namespace, deployment)), version)


def rollout_state(
    namespace: str, deployment: str, entry: DeploymentModel | None, config_version: int = 0
) -> RolloutState:
    """The event form of a deployment's entry (its serving version and newest rollout)."""
    if entry is None:
        return RolloutState(namespace=namespace, deployment=deployment, config_version=config_version)
    rollout = entry.rollout
    if rollout is None:
        return RolloutState(
            namespace=namespace,
            deployment=deployment,
            serving_version=entry.serving_version,
            config_version=config_version,
        )
    return RolloutState(
        config_version=config_version,
        namespace=namespace,
        deployment=deployment,
        rollout_id=rollout.rollout_id,
        phase=rollout.phase,
        from_version=rollout.from_version,
        to_version=rollout.to_version,
        serving_version=entry.serving_version,
        pinned_sessions=rollout.pinned_sessions,
        end_reason=rollout.end_reason,
        reason=rollout.reason,
        ready=list(rollout.ready),
        failed=list(rollout.failed),
    )
