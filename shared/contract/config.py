"""Configuration events: a service announces which version of a configuration document it now runs on."""

from __future__ import annotations

from typing import ClassVar

from shared.contract.base import Event, Token


class ConfigApplied(Event, frozen=True, kw_only=True, tag="config.applied"):
    family: ClassVar[str] = "config"

    name: Token
    version: int
    service: Token
    node: str = ""
