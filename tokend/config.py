"""Settings: defaults here, then the TOML file, then ``TOKEND_*`` variables, then flags.

Every field of :class:`Settings` is one setting, declared once: its default, its meaning,
its group, its unit and the values it may take. Its TOML key is the field name, its
environment variable ``TOKEND_`` + the upper-cased name. Durations are seconds and accept
fractions. ``tokend serve --help``, docs/settings.md's tables and ``config/tokend.toml``
are written from these declarations (tests/test_config.py holds them equal;
``python -m tests.test_config`` writes the tables and the file).
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Any, TypeVar


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it."""


class Group(StrEnum):
    """The sections settings are shown in: ``tokend serve --help``, docs/settings.md, the
    file."""

    NETWORK = "network"
    TLS = "TLS"
    CLOCKS = "clocks"
    TOKENS = "tokens"
    REDIS = "Redis"
    LIMITS = "limits"
    OPERATIONS = "operations"


GROUP_MEANINGS = {
    Group.NETWORK: "the listener, and what a connection has before its session starts",
    Group.TLS: "wss:// and https:// on the listener",
    Group.CLOCKS: "a session's heartbeats, WARN and EXPIRED, and its token's renewal",
    Group.TOKENS: "the tokens tokend signs and accepts, and their keys",
    Group.REDIS: "where sessions are kept, and how the node talks to it",
    Group.LIMITS: "what one client, one connection or the whole node may take",
    Group.OPERATIONS: "the process: its name, workers, logs, admin listener, drain and restarts",
}

SECONDS = "seconds"
BYTES = "bytes"

# Seconds between two reads of the keys directory by a node (tokend.server.node, off the
# event loop): a key rotated in or deleted by another process is used, published or
# dropped within this long.
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


def _items(text: str) -> list[str]:
    """The items of a comma-separated setting, stripped, empty ones left out."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _networks(text: str) -> list[IPv4Network | IPv6Network]:
    """Addresses and CIDRs as networks (an address alone: a network of one)."""
    return [ipaddress.ip_network(item) for item in _items(text)]


def _parses_as_networks(text: str) -> bool:
    """Raises ValueError naming an item that is neither an address nor a CIDR."""
    _networks(text)
    return True


def _strong_admin_token(token: str) -> bool:
    return not token or (
        len(token) >= ADMIN_TOKEN_MIN_LENGTH
        and len(set(token)) >= ADMIN_TOKEN_MIN_DISTINCT
        and token.isprintable()
        and token == token.strip()
    )


@dataclass(frozen=True, slots=True)
class Rule:
    """What a setting's value must be beyond its range: ``holds`` tells (or raises
    ValueError saying why not), ``text`` says it after "must be"."""

    text: str
    holds: Callable[[Any], bool]


@dataclass(frozen=True, slots=True)
class Declared:
    """One setting as declared beside its default (see :func:`_setting`)."""

    meaning: str
    group: Group
    unit: str
    at_least: float | None
    more_than: float | None
    at_most: float | None
    choices: tuple[str, ...]
    rule: Rule | None
    shown: str


_T = TypeVar("_T")


def _setting(
    default: _T,
    meaning: str,
    group: Group,
    *,
    unit: str = "",
    at_least: float | None = None,
    more_than: float | None = None,
    at_most: float | None = None,
    choices: tuple[str, ...] = (),
    rule: Rule | None = None,
    shown: str = "",
) -> _T:
    """A setting: its default; its one-line meaning; the group it is shown in; the unit
    of its value; the values it may take (a range, choices, a rule; those between
    settings are in ``ACROSS``); ``shown``: the default an empty value stands for."""
    declared = Declared(meaning, group, unit, at_least, more_than, at_most, choices, rule, shown)
    return field(default=default, metadata={"declared": declared})


@dataclass(frozen=True, slots=True)
class Settings:
    # network
    host: str = _setting("127.0.0.1", "address to listen on", Group.NETWORK)
    port: int = _setting(
        8765,
        "TCP port; 0 picks a free one (logged in the listening line)",
        Group.NETWORK,
        at_least=0,
        at_most=65535,
    )
    backlog: int = _setting(
        4096,
        "listen backlog (capped by net.core.somaxconn)",
        Group.NETWORK,
        at_least=1,
        at_most=65535,
    )
    proxy_protocol_from: str = _setting(
        "",
        "load balancers whose connections must begin with a PROXY protocol v1 or v2 header, "
        "whose client address then stands for the peer in per-IP caps and logs; from anyone "
        "else a PROXY header is refused; empty: none",
        Group.NETWORK,
        rule=Rule("addresses or CIDRs, comma-separated", _parses_as_networks),
    )
    allowed_origins: str = _setting(
        "",
        "exact Origin values allowed, comma-separated (a wrong one gets 403; none, from a "
        "non-browser client, is always allowed); empty: no check, safe since the token "
        "travels in HELLO, never in a cookie a foreign page could make a browser send",
        Group.NETWORK,
    )
    hello_timeout: float = _setting(
        5.0,
        "time for the opening (PROXY header, TLS and WebSocket handshakes), and then for "
        "HELLO (close 4008)",
        Group.NETWORK,
        unit=SECONDS,
        more_than=0,
    )
    send_timeout: float = _setting(
        10.0,
        "a connection whose writes stay stalled this long (the client reads nothing) is dropped",
        Group.NETWORK,
        unit=SECONDS,
        more_than=0,
    )
    # TLS
    tls_cert_file: str = _setting(
        "",
        "PEM certificate chain of the port; with tls_key_file it serves wss:// and https:// "
        "only, TLS 1.2 or later, and takes a changed pair without a restart; empty: plain TCP",
        Group.TLS,
    )
    tls_key_file: str = _setting("", "PEM private key of tls_cert_file", Group.TLS)
    tls_reload_interval: float = _setting(
        10.0,
        "how often the TLS files are checked for a change (new connections get the new pair)",
        Group.TLS,
        unit=SECONDS,
        more_than=0,
    )
    # clocks
    heartbeat_interval: float = _setting(
        30.0, "heartbeat cadence announced to clients", Group.CLOCKS, unit=SECONDS, more_than=0
    )
    warn_after: float = _setting(
        90.0, "silence before WARN", Group.CLOCKS, unit=SECONDS, more_than=0
    )
    expire_after: float = _setting(
        120.0, "silence before EXPIRED (close 4505)", Group.CLOCKS, unit=SECONDS, more_than=0
    )
    token_ttl: float = _setting(
        900.0,
        "lifetime of a renewed token",
        Group.CLOCKS,
        unit=SECONDS,
        at_least=1,
        rule=Rule("a whole number", float.is_integer),
    )
    renew_window: float = _setting(
        300.0,
        "a heartbeat renews the token when exp - now <= this",
        Group.CLOCKS,
        unit=SECONDS,
        more_than=0,
    )
    sweep_interval: float = _setting(
        0.1,
        "how often each node sweeps for due WARN/EXPIRED transitions",
        Group.CLOCKS,
        unit=SECONDS,
        more_than=0,
    )
    # tokens
    issuer: str = _setting("tokend", "iss claim issued and required", Group.TOKENS)
    audience: str = _setting("tokend", "aud claim issued and required", Group.TOKENS)
    algorithms: str = _setting(
        "EdDSA",
        "JWS algorithms accepted, comma-separated",
        Group.TOKENS,
        rule=Rule("at least one algorithm", lambda text: bool(_items(text))),
    )
    leeway: float = _setting(
        5.0,
        "clock skew tolerated when checking exp, iat and nbf",
        Group.TOKENS,
        unit=SECONDS,
        at_least=0,
    )
    keys_dir: str = _setting(
        "",
        "Ed25519 signing keys, one PEM file per kid (mode 0600)",
        Group.TOKENS,
        shown="<data_dir>/keys",
    )
    key_publish_delay: float = _setting(
        900.0,
        "a key added by tokend keys rotate is published at once and signs only this long "
        "after it was made",
        Group.TOKENS,
        unit=SECONDS,
        more_than=0,
    )
    jwks_max_age: float = _setting(
        300.0,
        "Cache-Control max-age of the JWKS",
        Group.TOKENS,
        unit=SECONDS,
        at_least=0,
    )
    # Redis
    redis_url: str = _setting(
        "",
        "redis://, rediss:// or unix:// URL; redis+cluster://host:port[,host:port] for a "
        "Redis Cluster, redis+sentinel://host:port[,host:port]/service[/db] through Sentinel "
        "(rediss+... for TLS; docs/scaling.md); empty: an embedded redis-server under data_dir",
        Group.REDIS,
    )
    key_prefix: str = _setting(
        "tokend",
        "prefix of every Redis key and channel",
        Group.REDIS,
        rule=Rule(
            "non-empty, without braces, colons or spaces",
            lambda prefix: bool(prefix) and not any(c in prefix for c in "{}: "),
        ),
    )
    redis_timeout: float = _setting(
        2.5,
        "deadline of every Redis call (then 1013 or a later replay, never a hang)",
        Group.REDIS,
        unit=SECONDS,
        more_than=0,
    )
    redis_pool_size: int = _setting(
        64,
        "Redis connections per node; callers wait beyond it, up to the deadline",
        Group.REDIS,
        at_least=4,
    )
    heartbeat_batch: int = _setting(
        2000,
        "most heartbeats per Redis round trip; when more wait, higher prio first and WARN "
        "sessions last",
        Group.REDIS,
        at_least=1,
    )
    off_redis: str = _setting(
        "leave",
        "what a node cut from Redis does with its connections: leave: a connection whose "
        "heartbeats it could not store until halfway from warn_after to expire_after is "
        "closed 1013, so that its client resumes on a node that reaches Redis before the "
        "cluster expires its session; "
        "hold: acknowledged from what the node knows until Redis is back (either way its "
        "last heartbeat is stored once Redis is back)",
        Group.REDIS,
        choices=("leave", "hold"),
    )
    heartbeat_gather: float = _setting(
        0.002,
        "how long a heartbeat that finds no Redis round trip in flight waits for others to "
        "share its round trip, while fewer heartbeats come per round trip than flush_lanes; "
        "0: at once. Under load a round trip is in flight and nothing waits",
        Group.REDIS,
        unit=SECONDS,
        at_least=0,
        at_most=1,
    )
    flush_lanes: int = _setting(
        4,
        "store round trips the heartbeat batcher keeps in flight at once, so that the node "
        "answers one batch while Redis runs the next; HELLOs: one at a time, batched behind it",
        Group.REDIS,
        at_least=1,
    )
    stream_maxlen: int = _setting(
        100000,
        "approximate cap of each of the 16 event stream shards",
        Group.REDIS,
        at_least=1,
    )
    durable_replicas: str = _setting(
        "auto",
        "replicas that must acknowledge a revocation, BYE or admin DELETE (Redis WAIT) before "
        "it is reported done; auto: every replica the deployment knows of; 0: no WAIT",
        Group.REDIS,
        rule=Rule(
            "auto or a number of replicas",
            lambda text: text == "auto" or (text.isascii() and text.isdigit()),
        ),
    )
    durable_timeout: float = _setting(
        0.25,
        "how long to wait for those acknowledgements, then the operation is reported unconfirmed",
        Group.REDIS,
        unit=SECONDS,
        more_than=0,
    )
    failover_check_interval: float = _setting(
        1.0,
        "how often a node compares the masters' replication ids to see a failover (and then "
        "writes again the revocations it heard)",
        Group.REDIS,
        unit=SECONDS,
        more_than=0,
    )
    # limits
    max_message_size: int = _setting(
        16384,
        "largest WebSocket message (larger: close 1009)",
        Group.LIMITS,
        unit=BYTES,
        at_least=1024,
        at_most=1 << 20,
    )
    max_connections_per_ip: int = _setting(
        256,
        "open connections per client IP; beyond it the handshake gets 429; 256 lets an "
        "office behind one NAT in but no single address take a quarter of "
        "max_pending_hellos; raise it where many clients share an address (carrier NAT); "
        "0: no cap",
        Group.LIMITS,
        at_least=0,
    )
    max_sessions_per_sub: int = _setting(
        64,
        "live sessions of one sub on this node (a resume does not count twice); beyond it "
        "close 4029; 64 fits one person's tabs and devices, yet one account given many "
        "tokens cannot hold the node's connections from many addresses; 0: no cap",
        Group.LIMITS,
        at_least=0,
    )
    max_frame_rate: float = _setting(
        5.0,
        "binary messages per second per connection after WELCOME (a fragmented message "
        "counts once; pongs, continuation and close frames are not counted), bursts up to "
        "10 times that; pings count in a bucket of their own at the same rate; beyond either "
        "close 4029; 0: no limit",
        Group.LIMITS,
        at_least=0,
    )
    max_pending_hellos: int = _setting(
        1024,
        "connections past the handshake still waiting for WELCOME; beyond it a new handshake "
        "gets 503 with Retry-After; 0: no cap",
        Group.LIMITS,
        at_least=0,
    )
    shed_lag: float = _setting(
        0.01,
        "mean event-loop lateness beyond which a node sheds load: 1013 to its worst-ranked "
        "sessions first (lowest prio, WARN first, never its best class), then 503 to new "
        "handshakes; 0: never shed",
        Group.LIMITS,
        unit=SECONDS,
        at_least=0,
    )
    shed_penalty: float = _setting(
        2.0,
        "how long a client shed with 1013 is refused before it costs a handshake or a token "
        "check (503 with Retry-After by source address, 1013 at HELLO by sub), ending early "
        "once its class is served again; 0: no penalty",
        Group.LIMITS,
        unit=SECONDS,
        at_least=0,
    )
    shed_pause: float = _setting(
        5.0,
        "while a node sheds every class but its best and is still overloaded: how long it "
        "stops reading a connection whose heartbeat it left unanswered (TCP back-pressure), "
        "never past half an interval after that connection's last answered heartbeat; at "
        "most 10 s, as max_frame_rate's burst holds ten seconds of frames; 0: close it "
        "with 1013 instead",
        Group.LIMITS,
        unit=SECONDS,
        at_least=0,
        at_most=10,
    )
    # operations
    node_name: str = _setting(
        "", "this node's name in events and logs", Group.OPERATIONS, shown="<hostname>-<pid>"
    )
    data_dir: str = _setting(
        "",
        "the embedded redis-server's socket, AOF and log, and the default keys_dir",
        Group.OPERATIONS,
        shown="$XDG_DATA_HOME/tokend, else ~/.local/share/tokend",
    )
    workers: int = _setting(
        1,
        "processes serving the port under one supervisor, which holds its sockets and "
        "replaces them one at a time on SIGHUP (tokend reload); each a node "
        "<node_name>-w<i>",
        Group.OPERATIONS,
        at_least=1,
    )
    log_format: str = _setting(
        "",
        "lines on stderr",
        Group.OPERATIONS,
        choices=("", "json", "console"),
        shown="console when stderr is a terminal, else json",
    )
    log_level: str = _setting(
        "info",
        "least level logged",
        Group.OPERATIONS,
        choices=("debug", "info", "warning", "error"),
    )
    admin_token: str = _setting(
        "",
        "bearer token of the admin API (never logged); empty: admin API and dashboard off",
        Group.OPERATIONS,
        rule=Rule(
            f"at least {ADMIN_TOKEN_MIN_LENGTH} characters, {ADMIN_TOKEN_MIN_DISTINCT} of them "
            "different, printable, no spaces around them, as python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))' makes",
            _strong_admin_token,
        ),
    )
    admin_host: str = _setting(
        "127.0.0.1",
        "address of the admin listener (metrics, health, admin API, dashboard)",
        Group.OPERATIONS,
    )
    admin_port: int = _setting(
        8766,
        "port of the admin listener; 0 picks a free one; -1 turns it off",
        Group.OPERATIONS,
        at_least=-1,
        at_most=65535,
    )
    admin_max_body: int = _setting(
        16384,
        "largest admin request body (larger: 413)",
        Group.OPERATIONS,
        unit=BYTES,
        at_least=1,
    )
    admin_allowed_hosts: str = _setting(
        "",
        "Host header values the admin listener answers, comma-separated (name or name:port; "
        "another gets 421, so a DNS-rebinding page cannot read it); * allows any",
        Group.OPERATIONS,
        shown="localhost, 127.0.0.1, [::1] and admin_host, each with and without the port",
    )
    admin_max_connections: int = _setting(
        64,
        "admin connections open at once; beyond it 503 and close; the main port's descriptor "
        "budget keeps this many free",
        Group.OPERATIONS,
        at_least=1,
    )
    history_interval: float = _setting(
        10.0,
        "how often a node samples its history (its rates and the sessions by state), which "
        "the dashboard charts",
        Group.OPERATIONS,
        unit=SECONDS,
        more_than=0,
    )
    history_span: float = _setting(
        3600.0,
        "how much history each node keeps, in memory and in the store",
        Group.OPERATIONS,
        unit=SECONDS,
        more_than=0,
    )
    drain_period: float = _setting(
        10.0,
        "on SIGTERM, open connections are closed with 1001 spread over this long; 0: all at once",
        Group.OPERATIONS,
        unit=SECONDS,
        at_least=0,
    )
    reload_drain_period: float = _setting(
        30.0,
        "in a rolling reload, the old workers close their connections with 1001 together, "
        "each spread over this long: the new workers resume sessions / reload_drain_period a "
        "second; 0: all at once",
        Group.OPERATIONS,
        unit=SECONDS,
        at_least=0,
    )
    reload_accept_queue: int = _setting(
        256,
        "in a rolling reload, an old worker holds its next 1001s while more connections than "
        "this wait to be accepted by the new workers (they are behind), at most "
        "reload_drain_period in all; 0: never hold (Linux only: elsewhere never held)",
        Group.OPERATIONS,
        at_least=0,
    )
    gc_interval: float = _setting(
        1.0,
        "time between the serving process's garbage collections of the objects made since "
        "the last one (each pass as short as they are few); 0: CPython's own schedule, whose "
        "whole passes stall the loop for every session's objects",
        Group.OPERATIONS,
        unit=SECONDS,
        at_least=0,
    )
    gc_full_interval: float = _setting(
        600.0,
        "time between collections of every object (a pause that grows with the sessions "
        "held) when gc_interval is set: cycles among objects that outlived a pass",
        Group.OPERATIONS,
        unit=SECONDS,
        more_than=0,
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
        return _items(self.algorithms)

    @property
    def proxy_networks(self) -> list[IPv4Network | IPv6Network]:
        """``proxy_protocol_from`` as networks (an address alone: a network of one)."""
        return _networks(self.proxy_protocol_from)

    @property
    def admin_host_list(self) -> list[str]:
        return [host.lower() for host in _items(self.admin_allowed_hosts)]

    @property
    def origin_list(self) -> list[str]:
        return _items(self.allowed_origins)

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


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local/share")
    return os.path.join(base, "tokend")


@dataclass(frozen=True, slots=True)
class Across:
    """A rule between settings, told of ``name``: ``text`` says it after "must be"."""

    name: str
    text: str
    holds: Callable[[Settings], bool]


# Checked in this order, after every setting's own range and rule.
ACROSS = (
    Across("warn_after", "less than expire_after", lambda s: s.warn_after < s.expire_after),
    Across(
        "heartbeat_interval",
        "less than warn_after",
        lambda s: s.heartbeat_interval < s.warn_after,
    ),
    Across("renew_window", "less than token_ttl", lambda s: s.renew_window < s.token_ttl),
    Across(
        "tls_cert_file",
        "set with tls_key_file, or both empty",
        lambda s: bool(s.tls_cert_file) == bool(s.tls_key_file),
    ),
    Across(
        "tls_key_file",
        "set with tls_cert_file, or both empty",
        lambda s: bool(s.tls_cert_file) == bool(s.tls_key_file),
    ),
    # A verifier's cached JWKS must expire before a key missing from it signs, though it
    # was fetched just before the node's refresh found the key.
    Across(
        "jwks_max_age",
        f"at most key_publish_delay less {KEYS_REFRESH_INTERVAL:g} s",
        lambda s: s.jwks_max_age <= s.key_publish_delay - KEYS_REFRESH_INTERVAL,
    ),
    # Port 0 would give every worker a port of its own.
    Across("workers", "1 when port is 0", lambda s: s.workers == 1 or s.port != 0),
    Across(
        "history_span",
        f"at most {MAX_HISTORY:,} times history_interval",
        lambda s: s.history_span / s.history_interval <= MAX_HISTORY,
    ),
    # WAIT's answer has to arrive within the socket timeout.
    Across(
        "durable_timeout",
        "less than redis_timeout",
        lambda s: s.durable_timeout < s.redis_timeout,
    ),
)
FIELDS = {f.name: f for f in fields(Settings)}


def env_name(field: str) -> str:
    return "TOKEND_" + field.upper()


def declared(name: str) -> Declared:
    """The setting's declaration (see :func:`_setting`)."""
    found: Declared = FIELDS[name].metadata["declared"]
    return found


def meaning(name: str) -> str:
    """The setting's one-line meaning (see :func:`_setting`)."""
    return declared(name).meaning


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _range(spec: Declared) -> str:
    low, high = spec.at_least, spec.at_most
    if low is not None and high is not None:
        return f"{_number(low)}..{_number(high)}"
    parts = [
        f"{words} {_number(bound)}"
        for words, bound in (
            ("at least", low),
            ("more than", spec.more_than),
            ("at most", high),
        )
        if bound is not None
    ]
    return ", ".join(parts)


def _choices(spec: Declared) -> str:
    """The choices in words; an empty one goes without saying (``shown`` says it)."""
    *most, last = [choice for choice in spec.choices if choice] or [""]
    return f"{', '.join(most)} or {last}" if most else last


def values(name: str) -> str:
    """The values the setting may take, in words: its unit, range, choices and rules."""
    spec = declared(name)
    unit_and_range = ", ".join(part for part in (spec.unit, _range(spec)) if part)
    rules = [spec.rule.text] if spec.rule else []
    rules += [rule.text for rule in ACROSS if rule.name == name]
    return "; ".join(part for part in (unit_and_range, _choices(spec), *rules) if part)


def shown_default(name: str) -> str:
    """The setting's default as the help and docs/settings.md write it."""
    default = FIELDS[name].default
    shown = declared(name).shown
    if shown or default == "":
        return shown or "empty"
    return f"{default:g}" if isinstance(default, float) else str(default)


def help_text(name: str) -> str:
    """The setting's line in ``--help``: its meaning, values and default."""
    allowed = values(name)
    return f"{meaning(name)} ({allowed + '; ' if allowed else ''}default: {shown_default(name)})"


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


def _own_problem(spec: Declared, value: Any) -> str | None:
    """What is wrong with a value by its setting's own declaration, said after "must be"."""
    out_of_range = (
        (spec.at_least is not None and value < spec.at_least)
        or (spec.more_than is not None and not value > spec.more_than)
        or (spec.at_most is not None and value > spec.at_most)
    )
    if out_of_range:
        return _range(spec)
    if spec.choices and value not in spec.choices:
        return _choices(spec)
    if spec.rule:
        try:
            if not spec.rule.holds(value):
                return spec.rule.text
        except ValueError as exc:
            return f"{spec.rule.text} ({exc})"
    return None


def validate(settings: Settings) -> Settings:
    """The settings, if each is what its declaration allows and every rule of ``ACROSS``
    holds; else a ConfigError naming the first setting that is not."""
    for name in FIELDS:
        problem = _own_problem(declared(name), getattr(settings, name))
        if problem:
            raise ConfigError(f"{name}: must be {problem}")
    for rule in ACROSS:
        if not rule.holds(settings):
            raise ConfigError(f"{rule.name}: must be {rule.text}")
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
