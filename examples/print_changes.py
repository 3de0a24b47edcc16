"""Hold a tokend session with the Python SDK and print its renewals and state changes.

    # a server whose clocks are short enough to watch renewals happen
    export TOKEND_DATA_DIR=/tmp/tokend-demo TOKEND_HEARTBEAT_INTERVAL=1 \\
           TOKEND_TOKEN_TTL=10 TOKEND_RENEW_WINDOW=5
    tokend serve &
    python examples/print_changes.py "$(tokend issue --sub alice)"

Ctrl-C logs out (BYE). The exit status is 0 after a logout, 1 if the session
ended for another reason (revoked, expired, taken over, ...).
"""

from __future__ import annotations

import asyncio
import sys
import time

from tokend.client import Backoff, Change, TokendError, connect

URL = "ws://127.0.0.1:8765/v1/ws"


async def main(url: str, token: str) -> int:
    try:
        async with connect(url, token, backoff=Backoff(base=0.5, cap=10)) as session:
            print(f"session {session.tid} of {session.sub!r}, heartbeat every "
                  f"{session.heartbeat_interval:g} s")  # fmt: skip
            async for change in session.changes():
                left = change.exp / 1000 - time.time()
                line = f"{time.strftime('%H:%M:%S')} {change.kind:<12} {session.state.name:<6}"
                if change.kind is Change.RENEWED:
                    line += f" token valid {left:.0f} s more"
                elif change.kind in (Change.RECONNECTING, Change.ENDED):
                    line += f" {change.code or ''} {change.detail}"
                print(line, flush=True)
    except TokendError as exc:  # refused at HELLO, or reconnect attempts used up
        print(f"cannot hold the session: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0 if session.error is None else 1


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: {sys.argv[0]} TOKEN [URL (default {URL})]")
    try:
        sys.exit(asyncio.run(main(sys.argv[2] if len(sys.argv) == 3 else URL, sys.argv[1])))
    except KeyboardInterrupt:  # the session was closed (BYE) on the way out
        sys.exit(0)
