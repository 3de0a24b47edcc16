"""Settings: defaults here, then the TOML file, then ``TOKEND_*`` variables, then flags.

Every field of :class:`Settings` is one setting. Its TOML key is the field name,
its environment variable ``TOKEND_`` + the upper-cased name. Durations are
seconds and accept fractions. ``config/tokend.toml`` lists every default and is
held to this file by a test.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it."""


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local/share")
    return os.path.join(base, "tokend")


def _setting(default: Any, meaning: str, *, shown: str = "") -> Any:
    """A setting's default and its one-line meaning, the one text of ``tokend serve
    --help``, docs/settings.md's table and config/tokend.toml (held equal by
    tests/test_config.py); ``shown`` writes a default that an empty value stands for."""
    return field(default=default, metadata={"meaning": meaning, "shown": shown})


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = _setting("127.0.0.1", "address to listen on")
    port: int = _setting(8765, "TCP port; 0 picks a free one (logged in the listening line)")
    tls_cert_file: str = _setting(
        "",
        "PEM certificate chain of the port; with tls_key_file it serves wss:// and https:// "
        "only, TLS 1.2 or later, and takes a changed pair without a restart; empty: plain TCP",
    )
    tls_key_file: str = _setting("", "PEM private key of tls_cert_file; set both or neither")
    tls_reload_interval: float = _setting(
        10.0, "how often the TLS files are checked for a change (new connections get the new pair)"
    )
    proxy_protocol_from: str = _setting(
        "",
        "addresses or CIDRs (comma-separated) of load balancers whose connections must begin "
        "with a PROXY protocol v1 or v2 header, whose client address then stands for the peer "
        "in per-IP caps and logs; from anyone else a PROXY header is refused; empty: none",
    )
    redis_url: str = _setting(
        "",
        "redis://, rediss:// or unix:// URL; redis+cluster://host:port[,host:port] for a "
        "Redis Cluster, redis+sentinel://host:port[,host:port]/service[/db] through Sentinel "
        "(rediss+... for TLS; docs/scaling.md); empty: an embedded redis-server under data_dir",
    )
    key_prefix: str = _setting(
        "tokend", "prefix of every Redis key and channel; no braces, colons or spaces"
    )
    keys_dir: str = _setting(
        "", "Ed25519 signing keys, one PEM file per kid (mode 0600)", shown="<data_dir>/keys"
    )
    data_dir: str = _setting(
        "",
        "the embedded redis-server's socket, AOF and log, and the default keys_dir",
        shown="$XDG_DATA_HOME/tokend, else ~/.local/share/tokend",
    )
    node_name: str = _setting("", "this node's name in events and logs", shown="<hostname>-<pid>")
    heartbeat_interval: float = _setting(
        30.0, "heartbeat cadence announced to clients; less than warn_after"
    )
    warn_after: float = _setting(90.0, "silence before WARN; less than expire_after")
    expire_after: float = _setting(120.0, "silence before EXPIRED (close 4505)")
    token_ttl: float = _setting(900.0, "lifetime of a renewed token, whole seconds")
    renew_window: float = _setting(
        300.0, "a heartbeat renews the token when exp - now <= this; less than token_ttl"
    )
    hello_timeout: float = _setting(
        5.0,
        "time for the opening (PROXY header, TLS and WebSocket handshakes), and then for "
        "HELLO (close 4008)",
    )
    redis_timeout: float = _setting(
        2.5, "deadline of every Redis call (then 1013 or a later replay, never a hang)"
    )
    redis_pool_size: int = _setting(
        64, "Redis connections per node, at least 4; callers wait beyond it, up to the deadline"
    )
    heartbeat_batch: int = _setting(
        2000,
        "most heartbeats per Redis round trip; when more wait, higher prio first and WARN "
        "sessions last",
    )
    heartbeat_gather: float = _setting(
        0.002,
        "seconds a heartbeat that finds no Redis round trip in flight waits for others to "
        "share its round trip (a sparse load's heartbeats each paid one); 0: at once. Under "
        "load a round trip is in flight and nothing waits",
    )
    flush_lanes: int = _setting(
        4,
        "store round trips the heartbeat batcher keeps in flight at once: the node answers "
        "one batch while Redis runs the next (4: ACK rate 0.96-1.05x bare websockets in bench "
        "heartbeat, 2: 0.67-0.92x); HELLOs: one at a time, batched behind it",
    )
    shed_lag: float = _setting(
        0.01,
        "mean event-loop lateness, seconds, beyond which a node sheds load: 1013 to its "
        "worst-ranked sessions first (lowest prio, WARN first, never its best class), then "
        "503 to new handshakes; 0: never shed",
    )
    shed_penalty: float = _setting(
        2.0,
        "seconds a client shed with 1013 is refused before it costs a handshake or a token "
        "check (503 with Retry-After by source address, 1013 at HELLO by sub), ending early "
        "once its class is served again; 0: no penalty",
    )
    sweep_interval: float = _setting(
        0.1, "how often each node sweeps for due WARN/EXPIRED transitions"
    )
    gc_interval: float = _setting(
        1.0,
        "seconds between the serving process's garbage collections of the objects made "
        "since the last one (each pass as short as they are few); 0: CPython's own "
        "schedule, whose whole passes stall the loop for every session's objects",
    )
    gc_full_interval: float = _setting(
        600.0,
        "seconds between collections of every object (a pause of about 10 us a session) "
        "when gc_interval is set: cycles among objects that outlived a pass",
    )
    issuer: str = _setting("tokend", "iss claim issued and required")
    audience: str = _setting("tokend", "aud claim issued and required")
    leeway: float = _setting(5.0, "clock skew tolerated when checking exp, iat and nbf")
    algorithms: str = _setting("EdDSA", "comma-separated JWS algorithms accepted")
    key_publish_delay: float = _setting(
        900.0,
        "a key added by tokend keys rotate is published at once and signs only this long "
        "after it was made",
    )
    jwks_max_age: float = _setting(
        300.0,
        "Cache-Control max-age of the JWKS; at most key_publish_delay less 1 s (the time a "
        "node takes to see a new key)",
    )
    max_message_size: int = _setting(
        16384, "largest WebSocket message, bytes, 1024..1048576 (larger: close 1009)"
    )
    allowed_origins: str = _setting(
        "",
        "exact Origin values allowed, comma-separated (a wrong one gets 403; none, from a "
        "non-browser client, is always allowed); empty: no check, safe since the token "
        "travels in HELLO, never in a cookie a foreign page could make a browser send",
    )
    max_connections_per_ip: int = _setting(
        256,
        "open connections per client IP; beyond it the handshake gets 429; 256 lets an "
        "office behind one NAT in but no single address take a quarter of "
        "max_pending_hellos; raise it where many clients share an address (carrier NAT); "
        "0: no cap",
    )
    max_sessions_per_sub: int = _setting(
        64,
        "live sessions of one sub on this node (a resume does not count twice); beyond it "
        "close 4029; 64 fits one person's tabs and devices, yet one account given many "
        "tokens cannot hold the node's connections from many addresses; 0: no cap",
    )
    max_frame_rate: float = _setting(
        5.0,
        "binary messages per second per connection after WELCOME (a fragmented message "
        "counts once; pongs, continuation and close frames are not counted), bursts up to "
        "10x; pings count in a bucket of their own at the same rate; beyond either close "
        "4029; 0: no limit",
    )
    max_pending_hellos: int = _setting(
        1024,
        "connections past the handshake still waiting for WELCOME; beyond it a new handshake "
        "gets 503 with Retry-After; 0: no cap",
    )
    send_timeout: float = _setting(
        10.0,
        "a connection whose writes stay stalled this long (the client reads nothing) is dropped",
    )
    backlog: int = _setting(4096, "listen backlog (capped by net.core.somaxconn)")
    stream_maxlen: int = _setting(100000, "approximate cap of each of the 16 event stream shards")
    workers: int = _setting(
        1,
        "processes serving the port under one supervisor, which holds its sockets and "
        "replaces them one at a time on SIGHUP (tokend reload); each a node "
        "<node_name>-w<i>; more than 1 needs a fixed port",
    )
    log_format: str = _setting(
        "",
        "json or console lines on stderr",
        shown="console when stderr is a terminal, else json",
    )
    log_level: str = _setting("info", "debug, info, warning or error")
    admin_token: str = _setting(
        "",
        "bearer token of the admin API (never logged), at least 32 characters, 8 of them "
        "different: python -c 'import secrets; print(secrets.token_urlsafe(32))'; empty: "
        "admin API and dashboard off",
    )
    admin_host: str = _setting(
        "127.0.0.1", "address of the admin listener (metrics, health, admin API, dashboard)"
    )
    admin_port: int = _setting(
        8766, "port of the admin listener; 0 picks a free one; -1 turns it off"
    )
    admin_max_body: int = _setting(16384, "largest admin request body, bytes (larger: 413)")
    admin_allowed_hosts: str = _setting(
        "",
        "Host header values the admin listener answers, comma-separated (name or name:port; "
        "another gets 421, so a DNS-rebinding page cannot read it); * allows any",
        shown="localhost, 127.0.0.1, [::1] and admin_host, each with and without the port",
    )
    admin_max_connections: int = _setting(
        64,
        "admin connections open at once; beyond it 503 and close; the main port's descriptor "
        "budget keeps this many free",
    )
    history_interval: float = _setting(
        10.0,
        "seconds between two samples of a node's history (its rates and the sessions by "
        "state), which the dashboard charts",
    )
    history_span: float = _setting(
        3600.0,
        "seconds of history each node keeps, in memory and in the store (at most 100,000 samples)",
    )
    drain_period: float = _setting(
        10.0, "on SIGTERM, open connections are closed with 1001 spread over this long"
    )
    reload_drain_period: float = _setting(
        30.0,
        "in a rolling reload, the old workers close their connections with 1001 together, "
        "each spread over this long: the new workers resume sessions / reload_drain_period a "
        "second",
    )
    reload_accept_queue: int = _setting(
        256,
        "in a rolling reload, an old worker holds its next 1001s while more connections than "
        "this wait to be accepted by the new workers (they are behind), at most "
        "reload_drain_period in all; 0: never hold (Linux only: elsewhere never held)",
    )
    restart_grace: float = _setting(
        60.0,
        "seconds added to the clocks of a session the server closed with 1001 (drain, reload, "
        "shutdown), so that a whole restart costs no session: 60 covers drain_period, a "
        "restart and the clients' jittered reconnects; 0: the close counts as a heartbeat",
    )
    durable_replicas: str = _setting(
        "auto",
        "replicas that must acknowledge a revocation, BYE or admin DELETE (Redis WAIT) before "
        "it is reported done; auto: every replica the deployment knows of; 0: no WAIT",
    )
    durable_timeout: float = _setting(
        0.25,
        "how long to wait for those acknowledgements, then the operation is reported "
        "unconfirmed; less than redis_timeout",
    )
    failover_check_interval: float = _setting(
        1.0,
        "how often a node compares the masters' replication ids to see a failover (and then "
        "writes again the revocations it heard)",
    )

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
    def proxy_networks(self) -> list[IPv4Network | IPv6Network]:
        """``proxy_protocol_from`` as networks (an address alone: a network of one)."""
        return [
            ipaddress.ip_network(item.strip())
            for item in self.proxy_protocol_from.split(",")
            if item.strip()
        ]

    @property
    def admin_host_list(self) -> list[str]:
        return [h.strip().lower() for h in self.admin_allowed_hosts.split(",") if h.strip()]

    @property
    def origin_list(self) -> list[str]:
        return [o.strip() for o in self.allowed_origins.split(",") if o.strip()]

    @property
    def durable_replica_count(self) -> int | None:
        """``durable_replicas`` as a number; None for "auto"."""
        return None if self.durable_replicas == "auto" else int(self.durable_replicas)

    @property
    def token_ttl_s(self) -> int:
        return round(self.token_ttl)

    def ms(self, name: str) -> int:
        """A duration setting in whole milliseconds."""
        return round(getattr(self, name) * 1000)


# Seconds between two reads of the keys directory by a node (tokend.server.node, off the event
# loop): a key rotated in or deleted by another process is used, published or dropped
# within this long.
KEYS_REFRESH_INTERVAL = 1.0
# An admin token's least length: 32 hex digits (secrets.token_hex(16)) are 128 bits;
# a password-like string that long is still guessable, which no check here can tell.
ADMIN_TOKEN_MIN_LENGTH = 32
# Fewer different characters is a placeholder ("changeme" x 4), not a random token: 32
# random hex digits have 8 or more different ones but for a chance under 1e-7.
ADMIN_TOKEN_MIN_DISTINCT = 8

# Samples of history a node keeps at most (history_span / history_interval): its memory
# and its list in the store stay bounded.
MAX_HISTORY = 100_000

_DURATIONS = (
    "heartbeat_interval",
    "warn_after",
    "expire_after",
    "token_ttl",
    "renew_window",
    "hello_timeout",
    "redis_timeout",
    "sweep_interval",
    "gc_full_interval",
    "send_timeout",
    "key_publish_delay",
    "durable_timeout",
    "failover_check_interval",
    "tls_reload_interval",
    "history_interval",
    "history_span",
)
_CHOICES = {
    "log_format": ("", "json", "console"),
    "log_level": ("debug", "info", "warning", "error"),
}
FIELDS = {f.name: f for f in fields(Settings)}


def env_name(field: str) -> str:
    return "TOKEND_" + field.upper()


def meaning(name: str) -> str:
    """The setting's one-line meaning (see :func:`_setting`)."""
    return str(FIELDS[name].metadata["meaning"])


def shown_default(name: str) -> str:
    """The setting's default as the help and docs/settings.md write it."""
    default = FIELDS[name].default
    shown = FIELDS[name].metadata["shown"]
    if shown or default == "":
        return shown or "empty"
    return f"{default:g}" if isinstance(default, float) else str(default)


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
    if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
        raise ConfigError("tls_cert_file: set both tls_cert_file and tls_key_file, or neither")
    try:
        settings.proxy_networks  # noqa: B018 - parsed to be checked
    except ValueError as exc:
        raise ConfigError(f"proxy_protocol_from: {exc}") from None
    if not settings.key_prefix or any(c in settings.key_prefix for c in "{}: "):
        raise ConfigError("key_prefix: must be non-empty, without braces, colons or spaces")
    if settings.leeway < 0:
        raise ConfigError("leeway: must not be negative")
    if not settings.algorithm_list:
        raise ConfigError("algorithms: name at least one JWS algorithm")
    if not 0 <= settings.jwks_max_age <= settings.key_publish_delay - KEYS_REFRESH_INTERVAL:
        # A verifier's cached JWKS must expire before a key missing from it signs, though
        # it was fetched just before the node's refresh found the key.
        raise ConfigError(
            f"jwks_max_age: must be at least 0 and at most key_publish_delay less "
            f"{KEYS_REFRESH_INTERVAL:g} s"
        )
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
    if settings.gc_interval < 0:
        raise ConfigError("gc_interval: must not be negative (0: CPython's own schedule)")
    if settings.shed_lag < 0:
        raise ConfigError("shed_lag: must not be negative (0 turns shedding off)")
    if settings.shed_penalty < 0:
        raise ConfigError("shed_penalty: must not be negative (0: no penalty)")
    if settings.heartbeat_batch < 1:
        raise ConfigError("heartbeat_batch: must be at least 1")
    if not 0 <= settings.heartbeat_gather <= 1:
        raise ConfigError("heartbeat_gather: must be 0 to 1 seconds")
    if settings.flush_lanes < 1:
        raise ConfigError("flush_lanes: must be at least 1")
    if not -1 <= settings.admin_port <= 65535:
        raise ConfigError("admin_port: must be -1 (off) or 0..65535")
    if settings.admin_max_body < 1:
        raise ConfigError("admin_max_body: must be at least 1 byte")
    if settings.admin_max_connections < 1:
        raise ConfigError("admin_max_connections: must be at least 1")
    if settings.history_span / settings.history_interval > MAX_HISTORY:
        raise ConfigError(
            f"history_span: at most {MAX_HISTORY:,} samples of history_interval; "
            "sample less often or keep less"
        )
    if settings.admin_token and (
        len(settings.admin_token) < ADMIN_TOKEN_MIN_LENGTH
        or len(set(settings.admin_token)) < ADMIN_TOKEN_MIN_DISTINCT
        or not settings.admin_token.isprintable()
        or settings.admin_token != settings.admin_token.strip()
    ):
        raise ConfigError(
            f"admin_token: too weak; use at least {ADMIN_TOKEN_MIN_LENGTH} characters, "
            f"{ADMIN_TOKEN_MIN_DISTINCT} of them different, printable, no spaces around them, "
            "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    for name in ("drain_period", "reload_drain_period"):
        if getattr(settings, name) < 0:
            raise ConfigError(f"{name}: must not be negative (0 closes all at once)")
    if settings.reload_accept_queue < 0:
        raise ConfigError("reload_accept_queue: must not be negative (0: never hold)")
    if settings.restart_grace < 0:
        raise ConfigError("restart_grace: must not be negative (0: a close counts as a heartbeat)")
    if settings.redis_pool_size < 4:
        raise ConfigError("redis_pool_size: must be at least 4")
    if settings.stream_maxlen < 1:
        raise ConfigError("stream_maxlen: must be at least 1")
    if settings.workers < 1:
        raise ConfigError("workers: must be at least 1")
    if settings.workers > 1 and settings.port == 0:
        # Port 0 would give every worker a port of its own.
        raise ConfigError("workers: more than 1 needs a fixed port, not 0")
    if settings.durable_replicas != "auto" and not (
        settings.durable_replicas.isascii() and settings.durable_replicas.isdigit()
    ):
        raise ConfigError("durable_replicas: must be auto or a number of replicas (0: no WAIT)")
    if settings.durable_timeout >= settings.redis_timeout:
        # WAIT's answer has to arrive within the socket timeout.
        raise ConfigError("durable_timeout: must be less than redis_timeout")
    for name, allowed in _CHOICES.items():
        if getattr(settings, name) not in allowed:
            named = ", ".join(choice for choice in allowed if choice)
            raise ConfigError(f"{name}: must be one of {named}")
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
