"""Structured JSON logs: one object per line, with the service name and any fields passed as ``extra``."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

from shared.plumbing import retries

_RESERVED = set(vars(logging.makeLogRecord({})))

NODE: contextvars.ContextVar[str] = contextvars.ContextVar("gpuwarden_log_node", default="")
"""The node a line is about when the record does not say: set by a process that hosts many nodes (the hollow
host) in each node's tasks, so every line an agent writes names its node."""


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, simulated: bool) -> None:
        super().__init__()
        self.service = service
        self.simulated = simulated

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.simulated:
            entry["simulated"] = True
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if "node" not in entry and (node := NODE.get()):
            entry["node"] = node
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(service: str, level: str = "INFO", simulated: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service, simulated))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("nats", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    retries.quiet_library_hooks()
