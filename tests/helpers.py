"""Small helpers tests share: settings pointed elsewhere, waiting for a condition without blind sleeps, and a
service's HTTP routes read."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from shared.plumbing.settings import Settings


def with_nats(settings: Settings, url: str) -> Settings:
    return replace(settings, nats=replace(settings.nats, servers=(url,)))


def with_redis(settings: Settings, url: str) -> Settings:
    return replace(settings, redis=replace(settings.redis, url=url))


async def eventually(
    predicate: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0, interval: float = 0.02
) -> Any:
    """Await until ``predicate()`` is truthy; returns its value. Tests wait for events, never sleep blindly."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def fetch(port: int, path: str) -> tuple[int, bytes]:
    return await asyncio.get_running_loop().run_in_executor(None, get, port, path)
