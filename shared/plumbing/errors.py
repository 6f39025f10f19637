"""The two kinds of handler failure, as the shared consumer loop understands them.

A handler raises ``TemporaryError`` when trying again later can succeed (a dependency is down, a lock is held):
the message is nak'ed with a delay and comes back. It raises ``PermanentError`` when the input itself is wrong
(a broken contract, an impossible request): the message is terminated and dead-lettered with the reason, and the
service carries on. Any other exception is treated as temporary, with a stack trace in the log, until the
redeliveries run out.
"""

from __future__ import annotations


class TemporaryError(Exception):
    def __init__(self, message: str, delay: float | None = None) -> None:
        super().__init__(message)
        self.delay = delay


class PermanentError(Exception):
    pass


class ConfigConflict(Exception):
    """A compare-and-set write lost: the document changed since the writer read it."""

    def __init__(self, name: str, expected: int, actual: int) -> None:
        super().__init__(
            f"config {name!r}: write expected version {expected} but the stored version is {actual}; "
            "read it again, reapply your change and retry"
        )
        self.name = name
        self.expected = expected
        self.actual = actual


class InvalidConfig(ValueError):
    """A configuration document failed validation; it is never stored or applied."""


class SettingsError(ValueError):
    """An environment variable or mounted file has a value the service cannot use."""


class ServerUnreachable(ConnectionError):
    """A server that is needed (NATS, Redis) does not answer; the message names it and the URL that was tried, in
    one line: what a person at a terminal needs first."""

    def __init__(self, server: str, url: str, detail: str = "") -> None:
        super().__init__(f"{server} at {url} is unreachable" + (f" ({detail})" if detail else ""))
        self.server = server
        self.url = url
