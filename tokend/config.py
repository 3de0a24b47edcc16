"""Settings: defaults here, then the TOML file, then ``TOKEND_*`` variables, then flags.

Every field of :class:`Settings` is one setting. Its TOML key is the field name,
its environment variable ``TOKEND_`` + the upper-cased name. Durations are
seconds and accept fractions. ``config/tokend.toml`` lists every default and is
held to this file by a test.
"""

from __future__ import annotations

import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it."""


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local/share")
    return os.path.join(base, "tokend")


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8765
    # Empty: start a private redis-server under data_dir (the embedded default).
    redis_url: str = ""
    key_prefix: str = "tokend"
    # Empty: <data_dir>/keys.
    keys_dir: str = ""
    data_dir: str = ""
    # Empty: <hostname>-<pid>. Shown in events and logs.
    node_name: str = ""
    heartbeat_interval: float = 30.0
    warn_after: float = 90.0
    expire_after: float = 120.0
    token_ttl: float = 900.0
    renew_window: float = 300.0
    hello_timeout: float = 5.0
    redis_timeout: float = 2.5
    # Connections this node may open to Redis; callers wait (up to redis_timeout) beyond it.
    redis_pool_size: int = 64
    # Most heartbeats stored in one Redis round trip. When more wait, higher token prio
    # goes first and sessions in WARN last, and the node sheds load (see shed_lag).
    heartbeat_batch: int = 2000
    # Mean event-loop lateness beyond which a node is overloaded and sheds load: it
    # refuses (1013) its worst-ranked sessions first, lowest prio and WARN first, never
    # its best-ranked class, then new handshakes (503). 0: never shed.
    shed_lag: float = 0.01
    # How often every node sweeps the deadline set for due WARN/EXPIRED transitions.
    sweep_interval: float = 0.1
    issuer: str = "tokend"
    audience: str = "tokend"
    leeway: float = 5.0
    # Comma-separated JWS algorithms accepted when verifying.
    algorithms: str = "EdDSA"
    max_message_size: int = 16384
    # Exact Origin values allowed at the handshake, comma-separated; empty: no check. A
    # handshake without Origin (a non-browser client) is always allowed; a wrong one gets 403.
    allowed_origins: str = ""
    # Open WebSocket connections per client IP; beyond it the handshake gets 429. 0: no cap.
    max_connections_per_ip: int = 0
    # Live sessions of one sub on this node; beyond it HELLO is closed with 4029. 0: no cap.
    max_sessions_per_sub: int = 0
    # Frames per second one connection may send after WELCOME, with bursts up to ten
    # times that; beyond it the connection is closed with 4029. 0: no limit.
    max_frame_rate: float = 5.0
    # Connections past the WebSocket handshake still waiting for WELCOME (HELLO not yet
    # sent, or being verified and stored); beyond it a new handshake gets HTTP 503 with
    # Retry-After, so a reconnect storm cannot starve the sessions already open. 0: no cap.
    max_pending_hellos: int = 1024
    # How long a connection's writes may stay stalled (the client reads nothing while its
    # buffers are full) before the connection is dropped. Bounds the memory a slow reader
    # holds on the server.
    send_timeout: float = 10.0
    # Listen backlog: pending TCP connections; too small a value turns a reconnect storm
    # into one-second SYN retransmits. The kernel caps it at net.core.somaxconn.
    backlog: int = 4096
    # Approximate cap of each events stream shard (XADD MAXLEN ~).
    stream_maxlen: int = 100000
    # Processes serving the port together (SO_REUSEPORT), under one supervisor;
    # each is a node named <node_name>-w<i>. More than 1 needs a fixed port.
    workers: int = 1
    log_format: str = "json"
    log_level: str = "info"
    # Bearer token of the admin API (/v1/* on the admin listener); empty: admin API and
    # dashboard disabled (404). Never logged.
    admin_token: str = ""
    # Admin listener (metrics, health, admin API, dashboard); admin_port -1 turns it off.
    admin_host: str = "127.0.0.1"
    admin_port: int = 8766
    # Largest request body the admin listener reads; larger gets 413.
    admin_max_body: int = 16384
    # On SIGTERM, open connections are closed with 1001 in batches spread over this long.
    drain_period: float = 10.0

    # Derived values, in the units the code uses.

    @property
    def resolved_data_dir(self) -> Path:
        return Path(self.data_dir or _default_data_dir())

    @property
    def resolved_keys_dir(self) -> Path:
        return Path(self.keys_dir) if self.keys_dir else self.resolved_data_dir / "keys"

    @property
    def resolved_node_name(self) -> str:
        return self.node_name or f"{socket.gethostname()}-{os.getpid()}"

    @property
    def algorithm_list(self) -> list[str]:
        return [a.strip() for a in self.algorithms.split(",") if a.strip()]

    @property
    def origin_list(self) -> list[str]:
        return [o.strip() for o in self.allowed_origins.split(",") if o.strip()]

    @property
    def token_ttl_s(self) -> int:
        return round(self.token_ttl)

    def ms(self, name: str) -> int:
        """A duration setting in whole milliseconds."""
        return round(getattr(self, name) * 1000)


_DURATIONS = (
    "heartbeat_interval",
    "warn_after",
    "expire_after",
    "token_ttl",
    "renew_window",
    "hello_timeout",
    "redis_timeout",
    "sweep_interval",
    "send_timeout",
)
_CHOICES = {"log_format": ("json", "console"), "log_level": ("debug", "info", "warning", "error")}
FIELDS = {f.name: f for f in fields(Settings)}


def env_name(field: str) -> str:
    return "TOKEND_" + field.upper()


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = FIELDS[name].type
    try:
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            if isinstance(value, bool) or not math.isfinite(number := float(value)):
                raise ValueError
            return number
        if not isinstance(value, str):
            raise ValueError
        return value
    except (ValueError, TypeError):
        raise ConfigError(f"{name} ({source}): expected {kind}, got {value!r}") from None


def validate(settings: Settings) -> Settings:
    for name in _DURATIONS:
        if not getattr(settings, name) > 0:
            raise ConfigError(f"{name}: must be a positive number of seconds")
    if settings.warn_after >= settings.expire_after:
        raise ConfigError("warn_after: must be less than expire_after")
    if settings.heartbeat_interval >= settings.warn_after:
        raise ConfigError("heartbeat_interval: must be less than warn_after")
    if settings.token_ttl_s < 1 or settings.token_ttl != settings.token_ttl_s:
        raise ConfigError("token_ttl: must be a whole number of seconds, at least 1")
    if settings.renew_window >= settings.token_ttl:
        raise ConfigError("renew_window: must be less than token_ttl")
    if not 0 <= settings.port <= 65535:
        raise ConfigError("port: must be 0..65535")
    if not settings.key_prefix or any(c in settings.key_prefix for c in "{}: "):
        raise ConfigError("key_prefix: must be non-empty, without braces, colons or spaces")
    if settings.leeway < 0:
        raise ConfigError("leeway: must not be negative")
    if not settings.algorithm_list:
        raise ConfigError("algorithms: name at least one JWS algorithm")
    if not 1024 <= settings.max_message_size <= 1 << 20:
        raise ConfigError("max_message_size: must be 1024..1048576 bytes")
    for name in (
        "max_connections_per_ip",
        "max_sessions_per_sub",
        "max_frame_rate",
        "max_pending_hellos",
    ):
        if getattr(settings, name) < 0:
            raise ConfigError(f"{name}: must not be negative (0 turns it off)")
    if not 1 <= settings.backlog <= 65535:
        raise ConfigError("backlog: must be 1..65535")
    if settings.shed_lag < 0:
        raise ConfigError("shed_lag: must not be negative (0 turns shedding off)")
    if settings.heartbeat_batch < 1:
        raise ConfigError("heartbeat_batch: must be at least 1")
    if not -1 <= settings.admin_port <= 65535:
        raise ConfigError("admin_port: must be -1 (off) or 0..65535")
    if settings.admin_max_body < 1:
        raise ConfigError("admin_max_body: must be at least 1 byte")
    if settings.drain_period < 0:
        raise ConfigError("drain_period: must not be negative (0 closes all at once)")
    if settings.redis_pool_size < 4:
        raise ConfigError("redis_pool_size: must be at least 4")
    if settings.stream_maxlen < 1:
        raise ConfigError("stream_maxlen: must be at least 1")
    if settings.workers < 1:
        raise ConfigError("workers: must be at least 1")
    if settings.workers > 1 and settings.port == 0:
        # Port 0 would give every worker a port of its own.
        raise ConfigError("workers: more than 1 needs a fixed port, not 0")
    for name, allowed in _CHOICES.items():
        if getattr(settings, name) not in allowed:
            raise ConfigError(f"{name}: must be one of {', '.join(allowed)}")
    return settings


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"config ({path}): {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config ({path}): {exc}") from None
    for key in data:
        if key not in FIELDS:
            raise ConfigError(f"{key} ({path}): unknown setting")
    return {key: _coerce(key, value, str(path)) for key, value in data.items()}


def load(
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Defaults < ``$TOKEND_CONFIG`` file < ``TOKEND_*`` variables < ``overrides``."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_path = (overrides or {}).get("config") or environ.get("TOKEND_CONFIG")
    if config_path:
        values.update(read_toml(Path(config_path)))
    for name in FIELDS:
        raw = environ.get(env_name(name))
        if raw is not None:
            values[name] = _coerce(name, raw.strip(), env_name(name))
    for name, value in (overrides or {}).items():
        if name != "config" and value is not None:
            values[name] = _coerce(name, value, "--" + name.replace("_", "-"))
    return validate(replace(Settings(), **values))
