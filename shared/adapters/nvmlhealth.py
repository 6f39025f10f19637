"""The health of this node's GPUs on NVML, behind ``NvmlGpus.health_events()`` (``shared.adapters.nvml``).

A thread waits on an NVML event set for critical XID errors and, between waits, checks that each GPU still answers.
A GPU that answers "GPU is lost" (to that check or to any call of the adapter) is reported once, as
``kind="lost"``, and left out until a driver validation sees it answer again. Every event goes to every
subscriber, on the subscriber's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from shared.plumbing.replies import as_text
from shared.ports.gpu import GpuError, GpuHealthEvent

log = logging.getLogger("shared.adapters.nvml")  # the adapter's logger, which log filters name

_CLOSED = object()

Handles = Callable[[], list[tuple[int, str, Any]]]
"""What gives the GPUs to watch: (index, UUID, NVML handle) of each GPU that answers."""


def is_nvml_error(nvml: Any, exc: BaseException) -> bool:
    """Whether ``exc`` is an error of the ``nvml`` module given (pynvml's, or a test's fake)."""
    cls = getattr(nvml, "NVMLError", None)
    return isinstance(cls, type) and isinstance(exc, cls)


def nvml_code(exc: BaseException) -> Any:
    return getattr(exc, "value", None)


def is_gpu_lost(nvml: Any, exc: BaseException) -> bool:
    return is_nvml_error(nvml, exc) and nvml_code(exc) == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", 15)


class NvmlHealthWatch:
    """The GPUs' health events for every subscriber, from one thread started by the first subscriber.

    Thread-safe: the lost GPUs are reported from the adapter's calls (run in worker threads) as well as from the
    watch's own thread."""

    def __init__(self, event_wait_ms: int) -> None:
        self.event_wait_ms = event_wait_ms
        self.closed = False
        self._lock = threading.Lock()
        self._lost: set[str] = set()
        self._subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def reported_lost(self, uuid: str) -> bool:
        return uuid in self._lost

    def report_lost(self, uuid: str, message: str) -> None:
        """Idempotent: a GPU is reported lost once, until it answers again."""
        with self._lock:
            if uuid in self._lost:
                return
            self._lost.add(uuid)
        log.error("GPU is lost", extra={"gpu": uuid, "error": message})
        self._publish(GpuHealthEvent(uuid=uuid, kind="lost", message=message))

    def answers_again(self, uuid: str) -> None:
        """The GPU answers again (a driver reload brings a lost GPU back): it is no longer left out."""
        with self._lock:
            self._lost.discard(uuid)

    def _publish(self, item: Any) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for loop, queue in subscribers:
            with contextlib.suppress(RuntimeError):  # the subscriber's loop has closed
                loop.call_soon_threadsafe(queue.put_nowait, item)

    async def events(
        self, nvml: Any, handles: Callable[[], list[tuple[int, str, Any]]]
    ) -> AsyncIterator[GpuHealthEvent]:
        """The events from now on, until ``close``; the first subscriber starts the thread, which watches the GPUs
        ``handles`` gives through the opened ``nvml`` module."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        entry = (asyncio.get_running_loop(), queue)
        with self._lock:
            self._subscribers.append(entry)
            if self._thread is None and not self.closed:
                self._thread = threading.Thread(
                    target=self._watch, args=(nvml, handles), name="nvml-health", daemon=True
                )
                self._thread.start()
        try:
            while not self.closed:
                item = await queue.get()
                if item is _CLOSED:
                    return
                yield item
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._subscribers.remove(entry)

    def _watch(self, nvml: Any, handles_of: Handles) -> None:
        """The health thread: wait for critical XIDs; between waits, check each GPU still answers."""
        event_set: Any = None
        handles: list[tuple[str, Any]] = []
        try:
            event_set = nvml.nvmlEventSetCreate()
        except Exception as exc:
            log.warning("NVML event set unavailable; only lost GPUs will be reported", extra={"error": str(exc)})
        try:
            handles = [(uuid, h) for _i, uuid, h in handles_of()]
        except GpuError as exc:
            log.warning("NVML health watch could not list GPUs", extra={"error": str(exc)})
        if event_set is not None:
            for uuid, h in handles:
                try:
                    nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, event_set)
                except Exception as exc:
                    log.info("GPU does not report XID events; skipped", extra={"gpu": uuid, "error": str(exc)})
        timeout_code = getattr(nvml, "NVML_ERROR_TIMEOUT", 10)
        try:
            while not self._stop.is_set():
                if event_set is None:
                    self._stop.wait(self.event_wait_ms / 1000)
                else:
                    try:
                        data = nvml.nvmlEventSetWait_v2(event_set, self.event_wait_ms)
                    except Exception as exc:
                        if is_nvml_error(nvml, exc) and nvml_code(exc) == timeout_code:
                            data = None
                        elif is_gpu_lost(nvml, exc):
                            data = None  # which GPU: the poll below finds out
                        else:
                            log.warning("NVML event wait failed", extra={"error": str(exc)})
                            self._stop.wait(self.event_wait_ms / 1000)
                            data = None
                    if data is not None:
                        self._xid(nvml, data)
                for uuid, h in handles:
                    if uuid in self._lost:
                        continue
                    try:
                        nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
                    except Exception as exc:
                        if is_gpu_lost(nvml, exc):
                            self.report_lost(uuid, f"nvmlDeviceGetTemperature: {exc}")
        finally:
            if event_set is not None:
                with contextlib.suppress(Exception):
                    nvml.nvmlEventSetFree(event_set)

    def _xid(self, nvml: Any, data: Any) -> None:
        try:
            uuid = as_text(nvml.nvmlDeviceGetUUID(data.device))
        except Exception as exc:
            uuid = "unknown"
            log.warning("XID event for a GPU whose UUID NVML did not give", extra={"error": str(exc)})
        xid = int(data.eventData)
        message = f"XID {xid}"
        gi = getattr(data, "gpuInstanceId", None)
        if gi is not None and gi != 0xFFFFFFFF:
            message += f" (GPU instance {gi}, compute instance {getattr(data, 'computeInstanceId', '?')})"
        log.warning("XID error", extra={"gpu": uuid, "xid": xid})
        self._publish(GpuHealthEvent(uuid=uuid, kind="xid", xid=xid, message=message))

    async def close(self) -> None:
        """Ends every subscriber's events and waits (5 s at most) for the thread to stop."""
        self.closed = True
        self._stop.set()
        self._publish(_CLOSED)
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, 5.0)
