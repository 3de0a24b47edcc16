"""``tokend connect``: a client on the SDK that prints each lifecycle change as a line.

The first thing to run against ``tokend serve``: it connects, heartbeats at the
server's cadence, and prints one line per change (connected, renewed, warned,
recovered, reconnecting, resumed, ended) until the session ends or SIGINT/SIGTERM
logs it out with BYE. Being the SDK's :class:`~tokend_client.ClientSession`, it proves its
resumes with the last WELCOME's session key, spreads its first reconnect after a
1001, honours Retry-After, and verifies a ``wss://`` server's certificate
(``--ca-file`` names a CA to trust).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import TextIO

from tokend.cli.common import LOGS, MINT, run_async, token_service
from tokend.config import Settings
from tokend.core import protocol as p
from tokend_client import Change, ClientSession, Lifecycle

_WILDCARD_HOSTS = {"", "0.0.0.0", "::"}


def default_url(settings: Settings) -> str:
    """``ws://<host>:<port>/v1/ws`` of the configured server (loopback if it binds all)."""
    host = "127.0.0.1" if settings.host in _WILDCARD_HOSTS else settings.host
    if ":" in host:
        host = f"[{host}]"
    return f"ws://{host}:{settings.port}{p.WS_PATH}"


def _clock(ms: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ms / 1000))


def format_change(change: Lifecycle, session: ClientSession) -> str:
    """One line for a change: local time, kind, then what matters for that kind."""
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    expiry = f"exp={_clock(change.exp)} (in {change.exp / 1000 - now:.0f} s)"
    match change.kind:
        case Change.CONNECTED:
            text = (
                f"tid={session.tid} sub={session.sub} {expiry} "
                f"heartbeat={session.heartbeat_interval:g} s; {change.detail}"
            )
        case Change.RENEWED | Change.RESUMED:
            text = f"{expiry}; {change.detail}"
        case Change.RECONNECTING | Change.ENDED:
            text = change.detail
            if change.code is not None:
                text = f"code={change.code} reason={change.reason or '-'} {text}"
            if change.error is not None:
                text += f" [{type(change.error).__name__}]"
        case _:
            text = change.detail
    return f"{stamp} {change.kind.value:<12} {text}"


async def hold(session: ClientSession, out: TextIO = sys.stdout) -> int:
    """Hold ``session``, printing its changes; 0 after a logout, 1 if it ended otherwise."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)

    async def close_on_signal() -> None:
        await stop.wait()
        await session.close()

    closer = asyncio.create_task(close_on_signal())
    session.open()
    try:
        async for change in session.changes():
            print(format_change(change, session), file=out, flush=True)
    finally:
        closer.cancel()
        await session.close()
        for sig in signals:
            loop.remove_signal_handler(sig)
    return 0 if session.error is None else 1


# The settings `tokend connect` reads; its --help shows these alone.
SETTINGS: tuple[str, ...] = ("host", "port", *MINT, *LOGS)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "connect",
        help="hold a session as a client and print each lifecycle change",
        description="Connect to the server with a token (--token, or one minted for --sub "
        "from the keys directory), heartbeat at the server's cadence and print one line "
        "per change: connected, renewed, warned, recovered, reconnecting, resumed, ended. "
        "Ctrl-C logs out (BYE). Exit status 0 after a logout, 1 if the session ended "
        "otherwise.",
    )
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--sub", help="mint a token for this subject with the server's keys")
    who.add_argument("--token", help="use this token")
    parser.add_argument(
        "--url", help="WebSocket URL (default ws://HOST:PORT/v1/ws from the settings)"
    )
    parser.add_argument(
        "--ttl", type=int, help="lifetime of a minted token in seconds (default: token_ttl)"
    )
    parser.add_argument(
        "--backoff-base",
        type=float,
        default=0.5,
        help="first reconnect waits up to this many seconds (default 0.5)",
    )
    parser.add_argument(
        "--backoff-cap",
        type=float,
        default=30.0,
        help="no reconnect waits longer than this many seconds (default 30)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        help="reconnect attempts in a row before giving up (default: no limit)",
    )
    parser.add_argument(
        "--going-away-window",
        type=float,
        default=5.0,
        help="after a close 1001 (server draining or restarting) the first reconnect waits "
        "a random time up to this many seconds (default 5)",
    )
    parser.add_argument(
        "--ca-file",
        help="for a wss:// URL: trust the CA certificates in this PEM file (default: the "
        "system's trusted CAs; the server's certificate is always verified)",
    )
    parser.set_defaults(func=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    from websockets.exceptions import InvalidURI

    from tokend_client import Backoff, TokendError

    token = args.token
    if token is None:
        tokens = token_service("connect", settings)
        token = tokens.mint(args.sub, ttl_s=args.ttl)
    url = args.url or default_url(settings)
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
        status.append(await hold(session))

    try:
        run_async(main())
    except (TokendError, InvalidURI) as exc:
        print(f"tokend connect: {exc}", file=sys.stderr)
        return 2
    return status[0]
