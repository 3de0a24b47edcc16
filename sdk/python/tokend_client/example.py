"""Hold a tokend session and print each change of its life: a complete program.

    python -m tokend_client.example TOKEN [--url URL] [--seconds N]

It connects, heartbeats at the server's cadence, takes in renewed tokens, reconnects
and resumes if the connection drops, and prints one line per change. Ctrl-C (or
``--seconds N``) logs out with BYE. The exit status is 0 after a logout, 1 if the
session ended for another reason (revoked, expired, taken over, a refused token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time

from tokend_client import Backoff, Change, ClientSession, TokendError, connect

DEFAULT_URL = "ws://127.0.0.1:8765/v1/ws"


def describe(session: ClientSession, kind: Change, exp: int, detail: str) -> str:
    """One line: the local time, the change, the session's state, and what it says."""
    left = exp / 1000 - time.time()
    line = f"{time.strftime('%H:%M:%S')} {kind.value:<12} {session.state.name:<6}"
    if kind is Change.RENEWED:
        return f"{line} token valid {left:.0f} s more"
    return f"{line} {detail}"


async def hold(url: str, token: str, seconds: float | None) -> int:
    """Hold the session until it ends, or log out after ``seconds``."""
    try:
        async with connect(url, token, backoff=Backoff(base=0.5, cap=10)) as session:
            print(
                f"session {session.tid} of {session.sub!r}, "
                f"heartbeat every {session.heartbeat_interval:g} s",
                flush=True,
            )
            if seconds is not None:
                asyncio.get_running_loop().call_later(
                    seconds, lambda: asyncio.ensure_future(session.close())
                )
            async for change in session.changes():
                detail = change.detail
                if change.code is not None:
                    detail = f"{change.code} {change.reason or change.meaning}: {detail}"
                print(describe(session, change.kind, change.exp, detail), flush=True)
        stats = session.stats
        print(f"{stats.heartbeats} heartbeats, {stats.acks} ACKs, {stats.renewals} renewals")
    except TokendError as exc:  # refused at HELLO, or reconnect attempts used up
        print(f"cannot hold the session: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0 if session.error is None else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokend_client.example",
        description="Hold a tokend session and print each change of its life.",
    )
    parser.add_argument("token", help="a token the server signed (tokend issue --sub NAME)")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    parser.add_argument("--seconds", type=float, help="log out after this many seconds")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):  # the session logged out on the way
        return asyncio.run(hold(args.url, args.token.strip(), args.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
