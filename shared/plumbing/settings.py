"""Settings from environment variables (and mounted files for secrets), each declared once.

A setting is a dataclass field (``setting``): its variable, default, documentation and parser in one place.
``settings_from_env`` reads every field a settings class declares, ``documented`` writes the ``DOCUMENTED``
mapping that ``tools.envdoc`` turns into docs/configuration.md; what relates one setting to another is checked
after, by the ``load`` of the settings (``load_settings`` here, each service's ``config.load``). Secrets are
wrapped in ``Secret`` so that no repr, log line or event ever shows them.
"""

from __future__ import annotations

import math
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Generic, NamedTuple, Protocol, TypeVar
from urllib.parse import unquote

from shared.contract.permissions import AGENT, Identity, identity_name, inbox_prefix
from shared.contract.subjects import Subjects
from shared.plumbing.errors import SettingsError


def public_url(url: str) -> str:
    """``url`` as it may be shown: a password in it (``redis://user:secret@host``) becomes ``***``."""
    return re.sub(r"^([a-z+]+://[^/@:]*:)[^/@]*@", r"\1***@", url)


_HOSTPORT = re.compile(r"^(?P<host>[^:]*|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")


class HostPort(NamedTuple):
    """Where a server listens: ``host`` ``0.0.0.0`` is every address, ``port`` 0 a free port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_host_port(name: str, raw: str, example: str = "0.0.0.0:8080") -> HostPort:
    match = _HOSTPORT.match(raw)
    if not match or int(match["port"]) > 65535:
        raise SettingsError(f"{name}={raw!r}: expected host:port, e.g. {example}")
    return HostPort(match["host"].strip("[]") or "0.0.0.0", int(match["port"]))


class Secret:
    """A value that never shows itself in a repr or a log line."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


T = TypeVar("T")
D = TypeVar("D")
"""A setting's default: a value of its parser's type, or None (unset: no value)."""
L = TypeVar("L", bound=str)
S = TypeVar("S", bound="Dataclass")


class Dataclass(Protocol):
    """A dataclass (typeshed's ``DataclassInstance``, which the KV agent's wheel cannot import)."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]


def _written(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Parse(Generic[T]):
    """How a setting's text becomes its value, and how its default is written in docs/configuration.md (empty:
    not at all)."""

    read: Callable[[str, str], T]
    """``(variable, its text)``: the value, or ``SettingsError`` naming the variable and what was expected. The text
    is never blank: a blank or unset variable is the default, without a call."""
    show: Callable[[T], str] = _written


@dataclass(frozen=True)
class Setting(Generic[T]):
    """A field's environment variable, what docs/configuration.md says of it and how its text is read."""

    variable: str
    text: str | None
    """None: documented in the ``DOCUMENTED`` of the module that owns the variable (read by several programs)."""
    parse: Parse[T]
    shown: str | None = None
    """The default in words, where it is not a value (one derived from another): ``(default: <shown>)``."""
    required: str | None = None
    """Why the variable must be set: an unset or blank one is refused with this reason."""
    or_file: bool = False
    """A secret: its value as given, blanks and all, or (unset) what the file ``<variable>_FILE`` names holds."""


_SETTING = "gpuwarden.setting"


def setting(
    variable: str,
    default: D,
    text: str | None,
    *,
    parse: Parse[T],
    shown: str | None = None,
    required: str | None = None,
    or_file: bool = False,
) -> D | T:
    """A dataclass field read from ``variable``: its default, its documentation and its parsing declared once.
    ``settings_from_env`` reads it, ``documented`` writes ``text (default …)`` for docs/configuration.md."""
    return field(default=default, metadata={_SETTING: Setting(variable, text, parse, shown, required, or_file)})


def _declared(f: Field[Any]) -> Setting[Any] | None:
    declared = f.metadata.get(_SETTING)
    return declared if isinstance(declared, Setting) else None


def _nested(f: Field[Any]) -> type[Dataclass] | None:
    """The settings class of a field that groups settings of its own (``tls: ScalerTls``), if it is one."""
    kind: object = type(f.default) if f.default is not MISSING else f.default_factory
    if isinstance(kind, type) and is_dataclass(kind) and any(_declared(g) for g in fields(kind)):
        return kind
    return None


def _file_text(name: str, path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise SettingsError(f"{name}={path}: cannot read: {exc.strerror}") from None


def settings_from_env(cls: type[S], env: Mapping[str, str] | None = None) -> S:
    """``cls`` with every declared setting read from ``env`` (a blank or unset variable is the field's default),
    or ``SettingsError`` naming the first variable that is wrong. What relates one setting to another is checked
    by the service's ``load`` afterwards."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in fields(cls):
        if (declared := _declared(f)) is not None:
            name, raw = declared.variable, env.get(declared.variable, "")
            if raw.strip():
                values[f.name] = declared.parse.read(name, raw if declared.or_file else raw.strip())
            elif declared.or_file and (path := env.get(f"{name}_FILE", "")):
                values[f.name] = declared.parse.read(name, _file_text(f"{name}_FILE", path))
            elif declared.required is not None:
                raise SettingsError(f"{name} is not set: {declared.required}")
        elif (group := _nested(f)) is not None:
            values[f.name] = settings_from_env(group, env)
    return cls(**values)


def documented(cls: type[Dataclass]) -> dict[str, str]:
    """``{variable: text (default …)}`` (or only the text, for a setting without a default to show, like a file
    that is not read unless given) for every setting ``cls`` declares: its module's ``DOCUMENTED``, which
    ``tools.envdoc`` writes into docs/configuration.md."""
    said: dict[str, str] = {}
    for f in fields(cls):
        if (declared := _declared(f)) is not None:
            if declared.text is None:
                continue
            value = "" if f.default in (None, "", ()) else declared.parse.show(f.default)
            if declared.shown is not None:
                said[declared.variable] = f"{declared.text} (default: {declared.shown})"
            else:
                said[declared.variable] = f"{declared.text} (default {value})" if value else declared.text
        elif (group := _nested(f)) is not None:
            said.update(documented(group))
    return said


def _seconds_in(
    name: str, raw: str, allow_zero: bool = False, minimum: float | None = None, maximum: float | None = None
) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a number of seconds") from None
    if minimum is not None and maximum is not None and not minimum <= value <= maximum:
        raise SettingsError(f"{name}={raw!r}: expected seconds between {minimum:g} and {maximum:g}")
    if minimum is not None and not (math.isfinite(value) and value >= minimum):
        raise SettingsError(f"{name}={raw!r}: expected at least {minimum:g} seconds")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise SettingsError(f"{name}={raw!r}: must be {'zero or more' if allow_zero else 'positive'}")
    return value


def seconds(*, allow_zero: bool = False, minimum: float | None = None, maximum: float | None = None) -> Parse[float]:
    """A duration: a number of seconds, positive (or zero, where zero means "off"), and within
    ``minimum``..``maximum`` where they are given."""
    return Parse(lambda name, raw: _seconds_in(name, raw, allow_zero, minimum, maximum))


def count(*, minimum: int = 1, maximum: int = 100_000) -> Parse[int]:
    """A whole number (how many at once, how many at most) within ``minimum``..``maximum``."""

    def read(name: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise SettingsError(f"{name}={raw!r}: expected a whole number") from None
        if not minimum <= value <= maximum:
            raise SettingsError(f"{name}={raw!r}: expected a whole number from {minimum} to {maximum}")
        return value

    return Parse(read)


def choice(choices: tuple[L, ...], *, case: Callable[[str], str] = str.lower, expected: str | None = None) -> Parse[L]:
    """One of ``choices``, the text given in ``case`` first (lower case; ``str.upper``; ``str`` to take it as
    given); the error says ``expected``, by default ``one of <the choices>``."""

    def read(name: str, raw: str) -> L:
        value = case(raw)
        for option in choices:
            if option == value:
                return option
        raise SettingsError(f"{name}={value!r}: expected {expected or 'one of ' + ', '.join(choices)}")

    return Parse(read)


def on_off() -> Parse[bool]:
    """A switch: ``on`` or ``off``."""
    switch = choice(("on", "off"))
    return Parse(lambda name, raw: switch.read(name, raw) == "on", lambda value: "on" if value else "off")


def absolute_path() -> Parse[Path]:
    """A path that must be absolute."""

    def read(name: str, raw: str) -> Path:
        if not raw.startswith("/"):
            raise SettingsError(f"{name}={raw!r}: expected an absolute path (e.g. / or /run/nvidia/driver)")
        return Path(raw)

    return Parse(read)


def any_path() -> Parse[Path]:
    """A path, taken as given: what must be there is found where it is used."""
    return Parse(lambda _, raw: Path(raw))


def any_text() -> Parse[str]:
    """Text as given, without surrounding blanks."""
    return Parse(lambda _, raw: raw)


def existing_file(expected: str = "") -> Parse[Path]:
    """A path to a file that exists; ``expected`` says what it should hold, in the error."""

    def read(name: str, raw: str) -> Path:
        path = Path(raw)
        if not path.is_file():
            raise SettingsError(f"{name}={raw}: no such file{f' (expected {expected})' if expected else ''}")
        return path

    return Parse(read)


def host_port(example: str = "0.0.0.0:8080") -> Parse[HostPort]:
    """``host:port`` (``[v6 address]:port``; an empty host is every address)."""
    return Parse(lambda name, raw: parse_host_port(name, raw, example))


def secret() -> Parse[Secret]:
    """A password, a token: never shown (``Secret``)."""
    return Parse(lambda _, raw: Secret(raw), lambda _: "")


def number(*, minimum: float) -> Parse[float]:
    """A number, at least ``minimum``."""

    def read(name: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise SettingsError(f"{name}={raw!r}: expected a number") from None
        if value < minimum:
            raise SettingsError(f"{name}={raw!r}: must be at least {minimum}")
        return value

    return Parse(read)


def matching(pattern: str, expected: str) -> Parse[str]:
    """Text that matches ``pattern`` (from its start); the error says ``expected``."""

    def read(name: str, raw: str) -> str:
        if not re.match(pattern, raw):
            raise SettingsError(f"{name}={raw!r}: {expected}")
        return raw

    return Parse(read)


@dataclass(frozen=True)
class TlsFiles:
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.ca is not None or self.cert is not None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        if self.cert:
            ctx.load_cert_chain(str(self.cert), str(self.key) if self.key else None)
        return ctx


def _servers(name: str, raw: str) -> tuple[str, ...]:
    servers = tuple(s.strip() for s in raw.split(",") if s)
    for server in servers:
        if not re.match(r"^(nats|tls|ws|wss)://", server):
            raise SettingsError(f"{name}={server!r}: expected nats://host:port or tls://host:port")
    return servers


def _redis_url(name: str, raw: str) -> str:
    if not re.match(r"^(redis|rediss|unix|redis\+sentinel|rediss\+sentinel)://", raw):
        raise SettingsError(f"{name}={public_url(raw)!r}: expected redis://, rediss://, unix:// or redis+sentinel://")
    sentinel_url(raw)  # a malformed Sentinel address is refused here, naming the variable
    return raw


def _file_descriptor(name: str, raw: str) -> int:
    if not raw.isdigit():
        raise SettingsError(f"{name}={raw!r}: expected a file descriptor number")
    return int(raw)


@dataclass(frozen=True)
class NatsTls(TlsFiles):
    ca: Path | None = setting(
        "GPUWARDEN_NATS_TLS_CA", None, "CA bundle to verify the NATS server", parse=existing_file()
    )
    cert: Path | None = setting(
        "GPUWARDEN_NATS_TLS_CERT",
        None,
        "client certificate for NATS mTLS (with GPUWARDEN_NATS_TLS_KEY)",
        parse=existing_file(),
    )
    key: Path | None = setting("GPUWARDEN_NATS_TLS_KEY", None, "client key for NATS mTLS", parse=existing_file())


@dataclass(frozen=True)
class RedisTls(TlsFiles):
    ca: Path | None = setting(
        "GPUWARDEN_REDIS_TLS_CA", None, "CA bundle to verify the Redis server", parse=existing_file()
    )
    cert: Path | None = setting(
        "GPUWARDEN_REDIS_TLS_CERT",
        None,
        "client certificate for Redis mTLS (with GPUWARDEN_REDIS_TLS_KEY)",
        parse=existing_file(),
    )
    key: Path | None = setting("GPUWARDEN_REDIS_TLS_KEY", None, "client key for Redis mTLS", parse=existing_file())


@dataclass(frozen=True)
class NatsSettings:
    servers: tuple[str, ...] = setting(
        "GPUWARDEN_NATS_URL",
        ("nats://127.0.0.1:4222",),
        "NATS server URL(s), comma separated",
        parse=Parse(_servers, ",".join),
    )
    user: str | None = setting(
        "GPUWARDEN_NATS_USER",
        None,
        "NATS user name (with GPUWARDEN_NATS_PASSWORD or _PASSWORD_FILE)",
        parse=any_text(),
    )
    password: Secret | None = setting(
        "GPUWARDEN_NATS_PASSWORD",
        None,
        "NATS password (prefer GPUWARDEN_NATS_PASSWORD_FILE)",
        parse=secret(),
        or_file=True,
    )
    token: Secret | None = setting(
        "GPUWARDEN_NATS_TOKEN", None, "NATS token (or GPUWARDEN_NATS_TOKEN_FILE)", parse=secret(), or_file=True
    )
    nkey_seed_file: Path | None = setting(
        "GPUWARDEN_NATS_NKEY_SEED_FILE", None, "file holding an NKey seed", parse=existing_file()
    )
    creds_file: Path | None = setting(
        "GPUWARDEN_NATS_CREDS_FILE", None, "NATS .creds file (JWT + seed)", parse=existing_file()
    )
    tls: TlsFiles = field(default_factory=NatsTls)
    replicas: int = setting(
        "GPUWARDEN_NATS_REPLICAS",
        1,
        "replicas of the JetStream streams the services create; 3 in production",
        parse=Parse(lambda name, raw: int(number(minimum=1).read(name, raw))),
    )
    token_file: Path | None = setting(
        "GPUWARDEN_NATS_TOKEN_FILE",
        None,
        "file holding the NATS token, read again at every (re)connect: a pod's projected service-account token, "
        "which the kubelet refreshes",
        parse=existing_file(),
    )
    """Read again at every (re)connect (a projected service-account token rotates); ``token`` is its first read.
    None when ``GPUWARDEN_NATS_TOKEN`` itself is set."""
    inbox_prefix: str = setting(
        "GPUWARDEN_NATS_INBOX_PREFIX",
        "",
        "the inbox prefix of this connection's replies, _INBOX.<user>",
        parse=matching(r"_INBOX\.[A-Za-z0-9_\-]+$", "expected _INBOX.<one token>"),
        shown="from GPUWARDEN_NATS_USER; for a KV agent authenticating with its pod's token, from "
        "GPUWARDEN_POD_NAME; else _INBOX",
    )
    """Where replies to this connection go (``_INBOX.<user>``, ``shared.contract.permissions.inbox_prefix``);
    empty: derived from ``user`` when there is one, else nats-py's ``_INBOX``."""


@dataclass(frozen=True)
class RedisSettings:
    url: str = setting(
        "GPUWARDEN_REDIS_URL",
        "redis://127.0.0.1:6379/0",
        "Redis URL, rediss:// for TLS; behind Sentinel redis+sentinel://host:port,host:port/<master name>/<db>, "
        "rediss+sentinel:// for TLS",
        parse=Parse(_redis_url),
    )
    username: str | None = setting("GPUWARDEN_REDIS_USERNAME", None, "Redis ACL user", parse=any_text())
    password: Secret | None = setting(
        "GPUWARDEN_REDIS_PASSWORD",
        None,
        "Redis password (prefer GPUWARDEN_REDIS_PASSWORD_FILE)",
        parse=secret(),
        or_file=True,
    )
    tls: TlsFiles = field(default_factory=RedisTls)
    sentinel_password: Secret | None = setting(
        "GPUWARDEN_REDIS_SENTINEL_PASSWORD",
        None,
        "password of the Sentinels themselves, when they require one (or _FILE)",
        parse=secret(),
        or_file=True,
    )


@dataclass(frozen=True)
class SentinelUrl:
    """A Redis reached through its Sentinels: ``redis+sentinel://[user[:password]@]host:port[,host:port...]
    /<master name>[/<db>]`` (``rediss+sentinel://``: TLS to the Sentinels and to Redis). Clients ask the
    Sentinels which server is the primary now, and ask again when it fails over."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: Secret | None = None
    tls: bool = False


_SENTINEL_URL = re.compile(
    r"^(?P<scheme>rediss?)\+sentinel://(?:(?P<user>[^:@/]*)(?::(?P<password>[^@/]*))?@)?(?P<hosts>[^/@]+)"
    r"/(?P<service>[^/]+)(?:/(?P<db>[^/]*))?/?$"
)


def sentinel_url(url: str) -> SentinelUrl | None:
    """The Sentinel address in ``url``; None for a plain ``redis://``, ``rediss://`` or ``unix://`` URL. Raises
    ``SettingsError`` saying what is wrong with a malformed ``redis+sentinel://`` one."""
    if not re.match(r"^rediss?\+sentinel://", url):
        return None
    name = "GPUWARDEN_REDIS_URL"
    shown = public_url(url)
    match = _SENTINEL_URL.match(url)
    if match is None:
        raise SettingsError(
            f"{name}={shown!r}: expected redis+sentinel://host:port[,host:port...]/<master name>[/<db>]"
        )
    sentinels = tuple(
        parse_host_port(name, hostport.strip(), "127.0.0.1:26379") for hostport in match["hosts"].split(",")
    )
    db = match["db"] or "0"
    if not db.isdigit():
        raise SettingsError(f"{name}={shown!r}: the database after the master name must be a number, not {db!r}")
    user, password = match["user"], match["password"]
    return SentinelUrl(
        sentinels=sentinels,
        service=unquote(match["service"]),
        db=int(db),
        username=unquote(user) if user else None,
        password=Secret(unquote(password)) if password else None,
        tls=match["scheme"] == "rediss",
    )


@dataclass(frozen=True)
class Settings:
    nats: NatsSettings = field(default_factory=NatsSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    root: str = setting(
        "GPUWARDEN_ROOT",
        "gw",
        "subject root, stream prefix and Redis key prefix",
        parse=matching(r"^[A-Za-z][A-Za-z0-9_\-]{0,31}$", "a letter, then up to 31 letters, digits, '_' or '-'"),
    )
    node: str = setting(
        "GPUWARDEN_NODE", "", "the node a node-scoped service runs on", parse=any_text(), shown="the host name"
    )
    """Empty: the host name (``load_settings``)."""
    backend: str = setting(
        "GPUWARDEN_BACKEND",
        "sim",
        "sim: simulated GPUs and cluster; real: NVML and the Kubernetes API",
        parse=choice(("sim", "real"), case=str, expected="'sim' or 'real'"),
    )
    http: HostPort = setting(
        "GPUWARDEN_HTTP_ADDR",
        HostPort("127.0.0.1", 0),
        "host:port of /healthz, /readyz and /metrics; port 0 takes a free port",
        parse=host_port(),
    )
    http_fd: int = setting(
        "GPUWARDEN_HTTP_FD",
        -1,
        "a listening socket the process inherits (from `gpuwarden up`, which holds the port for every restart) to "
        "serve HTTP on instead of binding GPUWARDEN_HTTP_ADDR",
        parse=Parse(_file_descriptor),
        shown="none",
    )
    log_level: str = setting(
        "GPUWARDEN_LOG_LEVEL",
        "INFO",
        "DEBUG, INFO, WARNING or ERROR",
        parse=choice(("DEBUG", "INFO", "WARNING", "ERROR"), case=str.upper, expected="DEBUG, INFO, WARNING or ERROR"),
    )
    config_reread_s: float = setting(
        "GPUWARDEN_CONFIG_REREAD_S",
        15.0,
        "seconds between full re-reads of the configuration from Redis",
        parse=number(minimum=0.1),
    )

    @property
    def simulated(self) -> bool:
        return self.backend == "sim"

    @property
    def http_host(self) -> str:
        return self.http.host

    @property
    def http_port(self) -> int:
        return self.http.port


DOCUMENTED = documented(Settings)
"""Every variable the common settings read, as docs/configuration.md lists it (tools.envdoc)."""


def _inbox_prefix(env: Mapping[str, str], root: str, user: str | None, token: bool) -> str:
    """Without ``GPUWARDEN_NATS_INBOX_PREFIX``: the one the auth callout gives a KV agent proving its pod with a
    token (``_INBOX.<root>-agent-<pod>``, from ``GPUWARDEN_POD_NAME``); empty: ``Bus.connect`` derives it from the
    user."""
    pod = env.get("GPUWARDEN_POD_NAME", "").strip()
    if user or not token or not pod:
        return ""
    try:
        return inbox_prefix(identity_name(Subjects(root), Identity(AGENT, pod=pod)))
    except ValueError as exc:
        raise SettingsError(f"GPUWARDEN_POD_NAME={pod!r}: {exc}") from None


def _check_tls(tls: TlsFiles, prefix: str) -> None:
    if tls.cert and not tls.key:
        raise SettingsError(f"{prefix}_CERT is set but {prefix}_KEY is not: mTLS needs both")


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read every common setting, or raise ``SettingsError`` naming the variable that is wrong."""
    env = os.environ if env is None else env
    settings = settings_from_env(Settings, env)
    nats = settings.nats
    _check_tls(nats.tls, "GPUWARDEN_NATS_TLS")
    _check_tls(settings.redis.tls, "GPUWARDEN_REDIS_TLS")
    if env.get("GPUWARDEN_NATS_TOKEN"):
        nats = replace(nats, token_file=None)  # the token is given: there is no file to read again
    if not nats.inbox_prefix:
        nats = replace(nats, inbox_prefix=_inbox_prefix(env, settings.root, nats.user, nats.token is not None))
    return replace(settings, nats=nats, node=settings.node or os.uname().nodename.split(".")[0])
