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

import asyncio
import signal
import sys
import time
from typing import TextIO

from tokend import protocol as p
from tokend.config import Settings
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


async def run(session: ClientSession, out: TextIO = sys.stdout) -> int:
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
