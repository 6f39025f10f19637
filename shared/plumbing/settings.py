"""Settings from environment variables (and mounted files for secrets), with documented defaults.

Secrets are wrapped in ``Secret`` so that no repr, log line or event ever shows them. Every variable a service
reads is listed in a ``DOCUMENTED`` and, from there, in docs/configuration.md. A service declares each of its
settings once, as a dataclass field (``setting``: variable, default, text, parser); ``settings_from_env`` reads
them all and ``documented`` writes its ``DOCUMENTED`` from the same declarations.
"""

from __future__ import annotations

import math
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar
from urllib.parse import unquote

from shared.contract.permissions import AGENT, Identity, identity_name, inbox_prefix
from shared.contract.subjects import Subjects
from shared.plumbing.errors import SettingsError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DOCUMENTED: dict[str, str] = {
    "GPUWARDEN_NATS_URL": "NATS server URL(s), comma separated (default nats://127.0.0.1:4222)",
    "GPUWARDEN_REDIS_URL": (
        "Redis URL (default redis://127.0.0.1:6379/0; rediss:// for TLS); behind Sentinel: "
        "redis+sentinel://host:port,host:port/<master name>/<db> (rediss+sentinel:// for TLS)"
    ),
    "GPUWARDEN_ROOT": "subject root, stream prefix and Redis key prefix (default gw)",
    "GPUWARDEN_NODE": "the node a node-scoped service runs on (default: the host name)",
    "GPUWARDEN_BACKEND": "sim (simulated GPUs and cluster) or real (NVML and the Kubernetes API); default sim",
    "GPUWARDEN_HTTP_ADDR": "host:port of /healthz, /readyz and /metrics (default 127.0.0.1:0, a free port)",
    "GPUWARDEN_HTTP_FD": "a listening socket the process inherits (from `gpuwarden up`, which holds the port "
    "for every restart) to serve HTTP on instead of binding GPUWARDEN_HTTP_ADDR (default: none)",
    "GPUWARDEN_LOG_LEVEL": "DEBUG, INFO, WARNING or ERROR (default INFO)",
    "GPUWARDEN_NATS_REPLICAS": "replicas of the JetStream streams the services create (default 1; 3 in production)",
    "GPUWARDEN_NATS_USER": "NATS user name (with GPUWARDEN_NATS_PASSWORD or _PASSWORD_FILE)",
    "GPUWARDEN_NATS_PASSWORD": "NATS password (prefer GPUWARDEN_NATS_PASSWORD_FILE)",
    "GPUWARDEN_NATS_TOKEN": "NATS token (or GPUWARDEN_NATS_TOKEN_FILE)",
    "GPUWARDEN_NATS_TOKEN_FILE": (
        "file holding the NATS token, read again at every (re)connect: a pod's projected service-account token, "
        "which the kubelet refreshes"
    ),
    "GPUWARDEN_NATS_INBOX_PREFIX": (
        "the inbox prefix of this connection's replies, _INBOX.<user> (default: from GPUWARDEN_NATS_USER; for a KV "
        "agent authenticating with its pod's token, from GPUWARDEN_POD_NAME; else _INBOX)"
    ),
    "GPUWARDEN_NATS_NKEY_SEED_FILE": "file holding an NKey seed",
    "GPUWARDEN_NATS_CREDS_FILE": "NATS .creds file (JWT + seed)",
    "GPUWARDEN_NATS_TLS_CA": "CA bundle to verify the NATS server",
    "GPUWARDEN_NATS_TLS_CERT": "client certificate for NATS mTLS (with GPUWARDEN_NATS_TLS_KEY)",
    "GPUWARDEN_NATS_TLS_KEY": "client key for NATS mTLS",
    "GPUWARDEN_REDIS_USERNAME": "Redis ACL user",
    "GPUWARDEN_REDIS_PASSWORD": "Redis password (prefer GPUWARDEN_REDIS_PASSWORD_FILE)",
    "GPUWARDEN_REDIS_SENTINEL_PASSWORD": "password of the Sentinels themselves, when they require one (or _FILE)",
    "GPUWARDEN_REDIS_TLS_CA": "CA bundle to verify the Redis server",
    "GPUWARDEN_REDIS_TLS_CERT": "client certificate for Redis mTLS (with GPUWARDEN_REDIS_TLS_KEY)",
    "GPUWARDEN_REDIS_TLS_KEY": "client key for Redis mTLS",
    "GPUWARDEN_CONFIG_REREAD_S": "seconds between full re-reads of the configuration from Redis (default 15)",
}


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


@dataclass(frozen=True)
class NatsSettings:
    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    user: str | None = None
    password: Secret | None = None
    token: Secret | None = None
    nkey_seed_file: Path | None = None
    creds_file: Path | None = None
    tls: TlsFiles = field(default_factory=TlsFiles)
    replicas: int = 1
    token_file: Path | None = None
    """Read again at every (re)connect (a projected service-account token rotates); ``token`` is its first read."""
    inbox_prefix: str = ""
    """Where replies to this connection go (``_INBOX.<user>``, ``shared.contract.permissions.inbox_prefix``);
    empty: derived from ``user`` when there is one, else nats-py's ``_INBOX``."""


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    password: Secret | None = None
    tls: TlsFiles = field(default_factory=TlsFiles)
    sentinel_password: Secret | None = None


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
    root: str = "gw"
    node: str = ""
    backend: str = "sim"
    http_host: str = "127.0.0.1"
    http_port: int = 0
    http_fd: int = -1
    log_level: str = "INFO"
    config_reread_s: float = 15.0

    @property
    def simulated(self) -> bool:
        return self.backend == "sim"


def public_url(url: str) -> str:
    """``url`` as it may be shown: a password in it (``redis://user:secret@host``) becomes ``***``."""
    return re.sub(r"^([a-z+]+://[^/@:]*:)[^/@]*@", r"\1***@", url)


_HOSTPORT = re.compile(r"^(?P<host>[^:]*|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")


def _secret(env: Mapping[str, str], name: str) -> Secret | None:
    if env.get(name):
        return Secret(env[name])
    path = env.get(f"{name}_FILE")
    if path:
        try:
            return Secret(Path(path).read_text().strip())
        except OSError as exc:
            raise SettingsError(f"{name}_FILE={path}: cannot read: {exc.strerror}") from None
    return None


def _file(env: Mapping[str, str], name: str) -> Path | None:
    value = env.get(name)
    if not value:
        return None
    path = Path(value)
    if not path.is_file():
        raise SettingsError(f"{name}={value}: no such file")
    return path


def _tls(env: Mapping[str, str], prefix: str) -> TlsFiles:
    tls = TlsFiles(_file(env, f"{prefix}_CA"), _file(env, f"{prefix}_CERT"), _file(env, f"{prefix}_KEY"))
    if tls.cert and not tls.key:
        raise SettingsError(f"{prefix}_CERT is set but {prefix}_KEY is not: mTLS needs both")
    return tls


def _float(env: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a number") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r}: must be at least {minimum}")
    return value


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


T = TypeVar("T")
L = TypeVar("L", bound=str)
S = TypeVar("S", bound="DataclassInstance")


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


_SETTING = "gpuwarden.setting"


def setting(
    variable: str,
    default: T,
    text: str | None,
    *,
    parse: Parse[T],
    shown: str | None = None,
    required: str | None = None,
) -> T:
    """A dataclass field read from ``variable``: its default, its documentation and its parsing declared once.
    ``settings_from_env`` reads it, ``documented`` writes ``text (default …)`` for docs/configuration.md."""
    return field(default=default, metadata={_SETTING: Setting(variable, text, parse, shown, required)})


def _declared(f: Field[Any]) -> Setting[Any] | None:
    declared = f.metadata.get(_SETTING)
    return declared if isinstance(declared, Setting) else None


def _nested(f: Field[Any]) -> type[DataclassInstance] | None:
    """The settings class of a field that groups settings of its own (``tls: ScalerTls``), if it is one."""
    kind: object = type(f.default) if f.default is not MISSING else f.default_factory
    if isinstance(kind, type) and is_dataclass(kind) and any(_declared(g) for g in fields(kind)):
        return kind
    return None


def settings_from_env(cls: type[S], env: Mapping[str, str] | None = None) -> S:
    """``cls`` with every declared setting read from ``env`` (a blank or unset variable is the field's default),
    or ``SettingsError`` naming the first variable that is wrong. What relates one setting to another is checked
    by the service's ``load`` afterwards."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in fields(cls):
        if (declared := _declared(f)) is not None:
            raw = env.get(declared.variable, "").strip()
            if raw:
                values[f.name] = declared.parse.read(declared.variable, raw)
            elif declared.required is not None:
                raise SettingsError(f"{declared.variable} is not set: {declared.required}")
        elif (group := _nested(f)) is not None:
            values[f.name] = settings_from_env(group, env)
    return cls(**values)


def documented(cls: type[DataclassInstance]) -> dict[str, str]:
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


def choice(choices: tuple[L, ...]) -> Parse[L]:
    """One of ``choices``, case ignored."""

    def read(name: str, raw: str) -> L:
        value = raw.lower()
        for option in choices:
            if option == value:
                return option
        raise SettingsError(f"{name}={value!r}: expected one of {', '.join(choices)}")

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


def _inbox_prefix(env: Mapping[str, str], root: str, user: str | None, token: bool) -> str:
    """``GPUWARDEN_NATS_INBOX_PREFIX``, or the one the auth callout gives a KV agent proving its pod with a token
    (``_INBOX.<root>-agent-<pod>``, from ``GPUWARDEN_POD_NAME``); empty: ``Bus.connect`` derives it from the user."""
    raw = env.get("GPUWARDEN_NATS_INBOX_PREFIX", "").strip()
    if raw:
        if not re.fullmatch(r"_INBOX\.[A-Za-z0-9_\-]+", raw):
            raise SettingsError(f"GPUWARDEN_NATS_INBOX_PREFIX={raw!r}: expected _INBOX.<one token>")
        return raw
    pod = env.get("GPUWARDEN_POD_NAME", "").strip()
    if user or not token or not pod:
        return ""
    try:
        return inbox_prefix(identity_name(Subjects(root), Identity(AGENT, pod=pod)))
    except ValueError as exc:
        raise SettingsError(f"GPUWARDEN_POD_NAME={pod!r}: {exc}") from None


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read every common setting, or raise ``SettingsError`` naming the variable that is wrong."""
    env = os.environ if env is None else env
    servers = tuple(s.strip() for s in env.get("GPUWARDEN_NATS_URL", "nats://127.0.0.1:4222").split(",") if s)
    for server in servers:
        if not re.match(r"^(nats|tls|ws|wss)://", server):
            raise SettingsError(f"GPUWARDEN_NATS_URL={server!r}: expected nats://host:port or tls://host:port")
    redis_url = env.get("GPUWARDEN_REDIS_URL", "redis://127.0.0.1:6379/0")
    if not re.match(r"^(redis|rediss|unix|redis\+sentinel|rediss\+sentinel)://", redis_url):
        raise SettingsError(
            f"GPUWARDEN_REDIS_URL={public_url(redis_url)!r}: expected redis://, rediss://, unix:// or redis+sentinel://"
        )
    sentinel_url(redis_url)  # a malformed Sentinel address is refused here, naming the variable
    backend = env.get("GPUWARDEN_BACKEND", "sim")
    if backend not in ("sim", "real"):
        raise SettingsError(f"GPUWARDEN_BACKEND={backend!r}: expected 'sim' or 'real'")
    level = env.get("GPUWARDEN_LOG_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise SettingsError(f"GPUWARDEN_LOG_LEVEL={level!r}: expected DEBUG, INFO, WARNING or ERROR")
    host, port = parse_host_port("GPUWARDEN_HTTP_ADDR", env.get("GPUWARDEN_HTTP_ADDR", "127.0.0.1:0"))
    raw_fd = env.get("GPUWARDEN_HTTP_FD", "").strip()
    if raw_fd and not raw_fd.isdigit():
        raise SettingsError(f"GPUWARDEN_HTTP_FD={raw_fd!r}: expected a file descriptor number")
    replicas = int(_float(env, "GPUWARDEN_NATS_REPLICAS", 1, minimum=1))
    root = env.get("GPUWARDEN_ROOT", "gw")
    if not re.match(r"^[A-Za-z][A-Za-z0-9_\-]{0,31}$", root):
        raise SettingsError(f"GPUWARDEN_ROOT={root!r}: a letter, then up to 31 letters, digits, '_' or '-'")
    node = env.get("GPUWARDEN_NODE") or os.uname().nodename.split(".")[0]
    user = env.get("GPUWARDEN_NATS_USER") or None
    token = _secret(env, "GPUWARDEN_NATS_TOKEN")
    return Settings(
        nats=NatsSettings(
            servers=servers,
            user=user,
            password=_secret(env, "GPUWARDEN_NATS_PASSWORD"),
            token=token,
            token_file=_file(env, "GPUWARDEN_NATS_TOKEN_FILE") if not env.get("GPUWARDEN_NATS_TOKEN") else None,
            nkey_seed_file=_file(env, "GPUWARDEN_NATS_NKEY_SEED_FILE"),
            creds_file=_file(env, "GPUWARDEN_NATS_CREDS_FILE"),
            tls=_tls(env, "GPUWARDEN_NATS_TLS"),
            replicas=replicas,
            inbox_prefix=_inbox_prefix(env, root, user, token is not None),
        ),
        redis=RedisSettings(
            url=redis_url,
            username=env.get("GPUWARDEN_REDIS_USERNAME") or None,
            password=_secret(env, "GPUWARDEN_REDIS_PASSWORD"),
            tls=_tls(env, "GPUWARDEN_REDIS_TLS"),
            sentinel_password=_secret(env, "GPUWARDEN_REDIS_SENTINEL_PASSWORD"),
        ),
        root=root,
        node=node,
        backend=backend,
        http_host=host,
        http_port=port,
        http_fd=int(raw_fd) if raw_fd else -1,
        log_level=level,
        config_reread_s=_float(env, "GPUWARDEN_CONFIG_REREAD_S", 15.0, minimum=0.1),
    )
