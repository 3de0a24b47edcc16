"""The ``tokend`` command: serve, reload, issue, events, connect, revoke, sessions, keys."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from tokend import config
from tokend.config import ConfigError, Settings

if TYPE_CHECKING:
    from tokend.store.sessions import Store

# Sessions read per round of `tokend sessions list`.
LIST_PAGE = 500
# `tokend revoke`: the master revoked it, but too few replicas acknowledged it in time.
EXIT_NOT_CONFIRMED = 3

# The settings each command reads (every one can also come from TOKEND_* or the
# config file); its --help shows these alone. serve reads them all.
_KEYS = ("keys_dir", "data_dir", "key_publish_delay", "token_ttl", "leeway")
_MINT = (*_KEYS, "issuer", "audience")
_REDIS = ("redis_url", "data_dir", "key_prefix", "redis_timeout")
_LOGS = ("log_format", "log_level")
COMMAND_SETTINGS: dict[str, tuple[str, ...]] = {
    "serve": tuple(config.FIELDS),
    "issue": (*_MINT, *_LOGS),
    "events": (*_REDIS, "node_name", *_LOGS),
    "connect": ("host", "port", *_MINT, *_LOGS),
    "revoke": (
        *_REDIS,
        "token_ttl",
        "stream_maxlen",
        "leeway",
        "durable_replicas",
        "durable_timeout",
        *_LOGS,
    ),
    "sessions": (*_REDIS, *_LOGS),
    "keys": (*_KEYS, *_LOGS),
    "reload": ("data_dir", *_LOGS),
}
# `tokend reload`: how long it waits for the reload by default, and how often it looks.
RELOAD_TIMEOUT_S = 600.0
RELOAD_POLL_S = 0.1


class _Parser(argparse.ArgumentParser):
    """Answers a wrong command line with one line, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    group = parser.add_argument_group(
        "settings",
        "each overrides TOKEND_<NAME> and the config file; durations in seconds",
    )
    group.add_argument("--config", help="TOML config file (TOKEND_CONFIG)")
    for name in dict.fromkeys(COMMAND_SETTINGS[command]):
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar=str(config.FIELDS[name].type).upper(),
            help=f"{config.meaning(name)} (default: {config.shown_default(name)})",
        )


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {name: getattr(args, name, None) for name in config.FIELDS}
    overrides["config"] = args.config
    return config.load(overrides)


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def cmd_serve(settings: Settings, args: argparse.Namespace) -> int:
    from tokend.pidfile import AlreadyRunning, PidFile
    from tokend.server import serve_until_signalled

    if args.worker:  # started by a supervisor, which holds the pid file
        _run(serve_until_signalled(settings, worker=True))
        _exit_now()
    if settings.workers > 1:
        from tokend.workers import supervise

        try:
            return supervise(settings, _worker_environ(args))
        except AlreadyRunning as exc:
            print(f"tokend serve: {exc}", file=sys.stderr)
            return 1
    pidfile = PidFile(settings.resolved_data_dir)
    try:
        pidfile.acquire(patience=0)
    except (AlreadyRunning, OSError) as exc:
        # Single nodes may share a data directory, or have none they may write (a
        # Redis URL and a keys directory of their own): tokend reload finds the first.
        import structlog

        structlog.get_logger("tokend.cli").warning("no pid file written", reason=str(exc))
    pidfile.write_status({"workers": 1, "state": "serving"})
    try:
        _run(serve_until_signalled(settings))
    finally:
        pidfile.release()
    return 0


def _exit_now() -> NoReturn:
    """End a worker that has stopped (its connections closed, Redis and logs flushed)
    without the interpreter's teardown: freeing a busy worker's objects one by one takes
    1-3 s of CPU at 10,000 connections, taken from the new workers of a reload that are
    resuming its sessions on the same cores."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker_environ(args: argparse.Namespace) -> dict[str, str]:
    """The environment a supervisor starts its workers with: its own, and the settings of
    its command line as TOKEND_* variables (above the config file, as flags are)."""
    environ = dict(os.environ)
    for name in config.FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            environ[config.env_name(name)] = str(value)
    if args.config:
        environ["TOKEND_CONFIG"] = args.config
    return environ


def cmd_reload(settings: Settings, args: argparse.Namespace) -> int:
    """SIGHUP to the supervisor on the data directory; wait for the reload's outcome."""
    import signal
    import time

    from tokend import pidfile

    data_dir = settings.resolved_data_dir

    def fail(message: str) -> int:
        print(f"tokend reload: {message}", file=sys.stderr)
        return 1

    try:
        pid = pidfile.running(data_dir)
    except pidfile.NoServer as exc:
        return fail(str(exc))
    status = pidfile.read_status(data_dir)
    if not status or status.get("state") in ("starting", "stopping"):
        state = status.get("state", "starting")
        return fail(f"the server (pid {pid}) is {state}; try again once it serves")
    if status["workers"] == 1:
        return fail(
            f"the server (pid {pid}) is one process, which cannot replace itself: run it "
            "under a supervisor (--workers), or restart it under socket activation "
            "(docs/operations.md)"
        )
    asked = status.get("reloads_requested", 0)
    os.kill(pid, signal.SIGHUP)
    if args.no_wait:
        print(f"tokend reload: SIGHUP sent to {pid}")
        return 0
    deadline = time.monotonic() + args.timeout
    # A reload answers this request once it has begun after it (reloads_done counts
    # the requests a finished reload had received when it began).
    while status.get("reloads_done", 0) <= asked:
        if time.monotonic() >= deadline:
            return fail(f"no outcome within {args.timeout:g} s; the reload goes on (pid {pid})")
        time.sleep(RELOAD_POLL_S)
        try:
            pidfile.running(data_dir)
        except pidfile.NoServer:
            return fail(f"the server (pid {pid}) exited during the reload")
        status = pidfile.read_status(data_dir)
    last = status["last_reload"]
    if last["result"] != "ok":
        return fail(f"reload failed after {last['seconds']:g} s: {last['reason']}")
    print(
        f"tokend reload: reloaded in {last['seconds']:g} s, generation "
        f"{last['generation']}: {', '.join(status['nodes'])}"
    )
    return 0


def cmd_issue(settings: Settings, args: argparse.Namespace) -> int:
    from tokend.tokens import KeyRing, TokenService

    tokens = TokenService(settings, KeyRing.open(settings.resolved_keys_dir))
    if args.count is None:
        print(tokens.mint(args.sub, ttl_s=args.ttl, prio=args.prio))
        return 0
    out = sys.stdout
    for n in range(1, args.count + 1):
        out.write(tokens.mint(f"{args.sub}-{n}", ttl_s=args.ttl, prio=args.prio) + "\n")
    return 0


def _redis_url(settings: Settings) -> str:
    from tokend.embedded import socket_url

    return settings.redis_url or socket_url(settings.resolved_data_dir)


def cmd_events(settings: Settings, args: argparse.Namespace) -> int:
    from tokend import events
    from tokend.store.keyspace import Keyspace
    from tokend.store.redis_client import open_client

    async def main() -> None:
        redis = open_client(_redis_url(settings), settings)
        keys = Keyspace(settings.key_prefix)
        if args.group:
            consumer = args.consumer or settings.resolved_node_name
            start = "0" if args.from_start else "$"
            stream = events.durable(redis, keys, args.group, consumer, start=start)
        elif args.from_start:
            stream = events.from_start(redis, keys)
        else:
            stream = events.live(redis, keys)
        async for event in stream:
            print(json.dumps(event, separators=(",", ":")), flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        _run(main())
    return 0


def cmd_connect(settings: Settings, args: argparse.Namespace) -> int:
    from websockets.exceptions import InvalidURI

    from tokend import cli_connect
    from tokend_client import Backoff, ClientSession, TokendError

    token = args.token
    if token is None:
        from tokend.tokens import KeyRing, TokenService

        tokens = TokenService(settings, KeyRing.open(settings.resolved_keys_dir))
        token = tokens.mint(args.sub, ttl_s=args.ttl)
    url = args.url or cli_connect.default_url(settings)
    try:
        backoff = Backoff(
            args.backoff_base, args.backoff_cap, args.max_attempts, args.going_away_window
        )
        session = ClientSession(url, token, backoff=backoff, ca_file=args.ca_file)
    except (ValueError, OSError, TokendError, InvalidURI) as exc:
        print(f"tokend connect: {exc}", file=sys.stderr)
        return 2
    status: list[int] = []

    async def main() -> None:
        status.append(await cli_connect.run(session))

    try:
        _run(main())
    except (TokendError, InvalidURI) as exc:
        print(f"tokend connect: {exc}", file=sys.stderr)
        return 2
    return status[0]


def _parse_tid(command: str, text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        print(f"tokend {command}: not a token id (UUID): {text}", file=sys.stderr)
        return None


def _with_store(command: str, settings: Settings, use: Callable[[Store], Awaitable[int]]) -> int:
    """Run ``use`` on a store over the configured Redis (the embedded one's socket when
    redis_url is empty); exit status 1 when Redis is unreachable."""
    from tokend.store.redis_client import open_client
    from tokend.store.sessions import Store
    from tokend.store.unavailable import StoreUnavailable

    async def main() -> int:
        redis = open_client(_redis_url(settings), settings)
        try:
            return await use(Store(redis, settings, settings.resolved_node_name))
        finally:
            await redis.aclose()

    try:
        return asyncio.run(main())
    except StoreUnavailable as exc:
        print(f"tokend {command}: redis unavailable ({exc})", file=sys.stderr)
        return 1


def cmd_revoke(settings: Settings, args: argparse.Namespace) -> int:
    tid = _parse_tid("revoke", args.tid)
    if tid is None:
        return 2

    from tokend.answers import EndOutcome
    from tokend.store.unavailable import NotConfirmed

    async def revoke(store: Store) -> int:
        try:
            result = await store.revoke(tid, by=f"cli:{socket.gethostname()}")
        except NotConfirmed as exc:
            print(
                f"tokend revoke: not confirmed: the master revoked {tid}, but {exc}; a "
                "failover may undo it: run tokend revoke again",
                file=sys.stderr,
            )
            return EXIT_NOT_CONFIRMED
        print(
            {
                EndOutcome.ENDED: "revoked live session",
                EndOutcome.BARRED: "revoked (no live session)",
                EndOutcome.ALREADY_ENDED: "already ended",
            }[result]
        )
        return 0

    return _with_store("revoke", settings, revoke)


def cmd_sessions(settings: Settings, args: argparse.Namespace) -> int:
    """``sessions show TID`` (JSON; exit 1 if unknown) or ``sessions list`` (JSON lines)."""
    if args.action == "show":
        tid = _parse_tid("sessions show", args.tid or "(missing)")
        if tid is None:
            return 2

        async def show(store: Store) -> int:
            view = await store.queries.session(tid)
            if view is None:
                print(f"tokend sessions: no session {tid}", file=sys.stderr)
                return 1
            print(json.dumps(view.as_json()))
            return 0

        return _with_store("sessions", settings, show)

    async def listing(store: Store) -> int:
        cursor: str | None = ""
        printed = 0
        while cursor is not None and (args.limit is None or printed < args.limit):
            page_size = min(LIST_PAGE, args.limit - printed) if args.limit else LIST_PAGE
            page, cursor = await store.queries.sessions(args.state, cursor, page_size)
            for view in page:
                print(json.dumps(view.as_json()))
            printed += len(page)
        return 0

    return _with_store("sessions", settings, listing)


def cmd_keys(settings: Settings, args: argparse.Namespace) -> int:
    import time

    from tokend.tokens import KeyRing, TokenService

    tokens = TokenService(settings, KeyRing.open(settings.resolved_keys_dir))
    if args.action == "rotate":
        kid = tokens.keys.rotate()
        print(kid)
        signs_from = time.gmtime(tokens.schedule.signs_from(kid))
        print(
            f"tokend keys: {kid} is published now and signs from "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', signs_from)} (key_publish_delay "
            f"{settings.key_publish_delay:g} s)",
            file=sys.stderr,
        )
    else:
        print(json.dumps(tokens.jwks(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tokend",
        description="WebSocket session server for short-lived signed tokens.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the server",
        description="Serve /v1/ws, /healthz, /readyz and /.well-known/jwks.json, and on the "
        "admin port /metrics, the admin API and the dashboard (docs/operations.md). With no "
        "Redis URL, starts a private redis-server under the data dir and stops it on exit. "
        "SIGTERM drains (1001 spread over drain_period); a second signal exits at once. "
        "With --workers N, a supervisor holds the port and runs N processes on it (worker i "
        "on admin port + i - 1), replaces them one at a time on SIGHUP (tokend reload), and "
        "exits 1 when one of them dies. Sockets from systemd socket activation (LISTEN_FDS) "
        "are served as they are; NOTIFY_SOCKET hears READY=1.",
    )
    # A supervisor's worker (tokend/workers.py): no pid file, no workers of its own.
    serve.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)

    issue = commands.add_parser(
        "issue",
        help="mint tokens with the server's keys",
        description="Print a token for SUB, or with --count N one token per line for "
        "SUB-1 .. SUB-N. Uses the keys directory only; no Redis needed.",
    )
    issue.add_argument("--sub", required=True, help="subject (user) of the token")
    issue.add_argument("--ttl", type=int, help="lifetime in seconds (default: token_ttl)")
    issue.add_argument(
        "--prio",
        type=int,
        default=5,
        choices=range(10),
        metavar="0..9",
        help="priority claim (default 5)",
    )
    issue.add_argument("--count", type=int, help="mint N tokens, SUB-1 .. SUB-N")
    issue.set_defaults(func=cmd_issue)

    events = commands.add_parser(
        "events",
        help="print session events as JSON lines",
        description="Print events live from pub/sub; --from-start replays the stream first.",
    )
    events.add_argument(
        "--from-start",
        action="store_true",
        help="replay the event stream from its start, then follow it",
    )
    events.add_argument(
        "--group",
        help="read through this consumer group (at-least-once; acknowledged once printed); "
        "a new group starts at new events, or at the oldest kept with --from-start",
    )
    events.add_argument(
        "--consumer", help="this reader's name in the group (default: the node name)"
    )
    events.set_defaults(func=cmd_events)

    connect = commands.add_parser(
        "connect",
        help="hold a session as a client and print each lifecycle change",
        description="Connect to the server with a token (--token, or one minted for --sub "
        "from the keys directory), heartbeat at the server's cadence and print one line "
        "per change: connected, renewed, warned, recovered, reconnecting, resumed, ended. "
        "Ctrl-C logs out (BYE). Exit status 0 after a logout, 1 if the session ended "
        "otherwise.",
    )
    who = connect.add_mutually_exclusive_group(required=True)
    who.add_argument("--sub", help="mint a token for this subject with the server's keys")
    who.add_argument("--token", help="use this token")
    connect.add_argument(
        "--url", help="WebSocket URL (default ws://HOST:PORT/v1/ws from the settings)"
    )
    connect.add_argument(
        "--ttl", type=int, help="lifetime of a minted token in seconds (default: token_ttl)"
    )
    connect.add_argument(
        "--backoff-base",
        type=float,
        default=0.5,
        help="first reconnect waits up to this many seconds (default 0.5)",
    )
    connect.add_argument(
        "--backoff-cap",
        type=float,
        default=30.0,
        help="no reconnect waits longer than this many seconds (default 30)",
    )
    connect.add_argument(
        "--max-attempts",
        type=int,
        help="reconnect attempts in a row before giving up (default: no limit)",
    )
    connect.add_argument(
        "--going-away-window",
        type=float,
        default=5.0,
        help="after a close 1001 (server draining or restarting) the first reconnect waits "
        "a random time up to this many seconds (default 5)",
    )
    connect.add_argument(
        "--ca-file",
        help="for a wss:// URL: trust the CA certificates in this PEM file (default: the "
        "system's trusted CAs; the server's certificate is always verified)",
    )
    connect.set_defaults(func=cmd_connect)

    revoke = commands.add_parser(
        "revoke",
        help="revoke a token by its id",
        description="End the session of token TID (its connection is closed with 4506 "
        "wherever it is) and bar the token from starting a new one. Exit status 0 once "
        'durable_replicas replicas hold it, 3 ("not confirmed") when they did not '
        "acknowledge it within durable_timeout (a Redis failover may undo it: run it "
        "again), 1 when Redis is unreachable. --durable-replicas and --durable-timeout "
        "set both for this call.",
    )
    revoke.add_argument("tid", help="token id (the jti claim, a UUID)")
    revoke.set_defaults(func=cmd_revoke)

    sessions = commands.add_parser(
        "sessions",
        help="show one session or list live sessions",
        description="'show TID' prints the session of token TID as JSON (its tombstone, "
        "state ENDED, once it has ended; exit status 1 if unknown); 'list' prints every "
        "live session of every node, one JSON object per line. Reads Redis directly, "
        "like the admin API's /v1/sessions.",
    )
    sessions.add_argument("action", choices=("show", "list"))
    sessions.add_argument("tid", nargs="?", help="token id, for 'show'")
    sessions.add_argument("--state", choices=("ACTIVE", "WARN"), help="only sessions in it")
    sessions.add_argument("--limit", type=int, help="print at most this many")
    sessions.set_defaults(func=cmd_sessions)

    keys = commands.add_parser(
        "keys",
        help="show or rotate signing keys",
        description="'show' prints the JWKS as served; 'rotate' adds a key, published "
        "by every node within a second, that signs after key_publish_delay (older keys "
        "keep verifying until their tokens have expired).",
    )
    keys.add_argument("action", choices=("show", "rotate"))
    keys.set_defaults(func=cmd_keys)

    reload = commands.add_parser(
        "reload",
        help="replace the workers of a running supervisor, one at a time",
        description="Find the server on the data directory (its tokend.pid), send it SIGHUP "
        "and wait until the rolling reload has finished: every worker replaced by a new "
        "process started from the code and config file as they are now, without closing "
        "the port (docs/operations.md). Exit status 0 when it succeeded; 1 with a one-line "
        "reason when no server runs, it is a single process, the reload failed (the old "
        "workers keep serving) or it took longer than --timeout.",
    )
    reload.add_argument(
        "--timeout",
        type=float,
        default=RELOAD_TIMEOUT_S,
        help=f"seconds to wait for the outcome (default {RELOAD_TIMEOUT_S:g})",
    )
    reload.add_argument(
        "--no-wait", action="store_true", help="send SIGHUP and return without waiting"
    )
    reload.set_defaults(func=cmd_reload)

    for command, sub in commands.choices.items():
        _add_settings(sub, command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = _settings(args)
    except ConfigError as exc:
        print(f"tokend: configuration error: {exc}", file=sys.stderr)
        return 2
    from tokend import logs

    logs.configure(settings.log_format, settings.log_level)
    try:
        return int(args.func(settings, args))
    except ConfigError as exc:  # found on use, e.g. a redis_url that cannot be parsed
        print(f"tokend: configuration error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from tokend.activation import ActivationError
        from tokend.embedded import EmbeddedError

        if isinstance(exc, (EmbeddedError, OSError, ActivationError)):
            print(f"tokend: {exc}", file=sys.stderr)
            return 1
        raise
