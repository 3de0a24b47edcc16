"""``tokend revoke``: end a session wherever it is, and bar its token."""

from __future__ import annotations

import argparse
import socket
import sys
from typing import TYPE_CHECKING

from tokend.cli.common import LOGS, REDIS, parse_tid, with_store
from tokend.config import Settings

if TYPE_CHECKING:
    from tokend.store.sessions import Store


# The settings `tokend revoke` reads; its --help shows these alone.
SETTINGS: tuple[str, ...] = (
    *REDIS,
    "token_ttl",
    "stream_maxlen",
    "leeway",
    "durable_replicas",
    "durable_timeout",
    *LOGS,
)
# The master revoked it, but too few replicas acknowledged it in time.
EXIT_NOT_CONFIRMED = 3


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "revoke",
        help="revoke a token by its id",
        description="End the session of token TID (its connection is closed with 4506 "
        "wherever it is) and bar the token from starting a new one. Exit status 0 once "
        'durable_replicas replicas hold it, 3 ("not confirmed") when they did not '
        "acknowledge it within durable_timeout (a Redis failover may undo it: run it "
        "again), 1 when Redis is unreachable. --durable-replicas and --durable-timeout "
        "set both for this call.",
    )
    parser.add_argument("tid", help="token id (the jti claim, a UUID)")
    parser.set_defaults(func=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    tid = parse_tid("revoke", args.tid)
    if tid is None:
        return 2

    from tokend.core.store_messages import EndOutcome
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

    return with_store("revoke", settings, revoke)
