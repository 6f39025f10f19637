"""The agent's asyncio loop in a thread of its own, beside vLLM's synchronous hooks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class AgentLoop:
    """An asyncio loop in a daemon thread: vLLM's hooks are synchronous, the agent, its store and NATS are not.
    ``ordered`` work runs one item at a time in submission order (a block copied before the session is claimed
    would otherwise be lost); ``call`` waits for a coroutine's result."""

    def __init__(self, name: str = "gpuwarden-kv") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._queue: asyncio.Queue[tuple[Callable[[], Coroutine[Any, Any, Any]], concurrent.futures.Future[Any]]]
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._queue = asyncio.Queue()
        self._worker = self.loop.create_task(self._drain())
        self._ready.set()
        self.loop.run_forever()

    async def _drain(self) -> None:
        while True:
            make, future = await self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(await make())
                except BaseException as exc:  # handed to whoever waits
                    future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise

    def ordered(self, make: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self._queue.put_nowait, (make, future))
        return future

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Cancel what is left (the queue's worker, any pending work), then stop the loop and its thread."""
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop)
        self._thread.join(timeout=5)
        with contextlib.suppress(RuntimeError):
            self.loop.close()
