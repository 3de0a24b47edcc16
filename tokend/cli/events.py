"""``tokend events``: print session events as JSON lines."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from tokend.cli.common import LOGS, REDIS, redis_url, run_async, unreachable
from tokend.config import Settings

# The settings `tokend events` reads; its --help shows these alone.
SETTINGS: tuple[str, ...] = (*REDIS, "node_name", *LOGS)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "events",
        help="print session events as JSON lines",
        description="Print events live from pub/sub; --from-start replays the stream first.",
    )
    parser.add_argument(
        "--from-start",
        action="store_true",
        help="replay the event stream from its start, then follow it",
    )
    parser.add_argument(
        "--group",
        help="read through this consumer group (at-least-once; acknowledged once printed); "
        "a new group starts at new events, or at the oldest kept with --from-start",
    )
    parser.add_argument(
        "--consumer", help="this reader's name in the group (default: the node name)"
    )
    parser.set_defaults(func=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    from tokend.store import events
    from tokend.store.keyspace import Keyspace
    from tokend.store.redis_client import open_client
    from tokend.store.unavailable import UNAVAILABLE

    async def main() -> None:
        redis = open_client(redis_url(settings), settings)
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

    try:
        with contextlib.suppress(KeyboardInterrupt):
            run_async(main())
    except UNAVAILABLE as exc:
        print(unreachable("events", settings, exc), file=sys.stderr)
        return 1
    return 0
