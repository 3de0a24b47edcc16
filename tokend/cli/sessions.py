"""``tokend sessions``: show one session or list the live ones."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from tokend.cli.common import LOGS, REDIS, parse_tid, with_store
from tokend.config import Settings

if TYPE_CHECKING:
    from tokend.store.sessions import Store


# The settings `tokend sessions` reads; its --help shows these alone.
SETTINGS: tuple[str, ...] = (*REDIS, *LOGS)
# Sessions read per round of `tokend sessions list`.
LIST_PAGE = 500


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "sessions",
        help="show one session or list live sessions",
        description="'show TID' prints the session of token TID as JSON (its tombstone, "
        "state ENDED, once it has ended; exit status 1 if unknown); 'list' prints every "
        "live session of every node, one JSON object per line. Reads Redis directly, "
        "like the admin API's /v1/sessions.",
    )
    parser.add_argument("action", choices=("show", "list"))
    parser.add_argument("tid", nargs="?", help="token id, for 'show'")
    parser.add_argument("--state", choices=("ACTIVE", "WARN"), help="only sessions in it")
    parser.add_argument("--limit", type=int, help="print at most this many")
    parser.set_defaults(func=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """``sessions show TID`` (JSON; exit 1 if unknown) or ``sessions list`` (JSON lines)."""
    if args.action == "show":
        tid = parse_tid("sessions show", args.tid or "(missing)")
        if tid is None:
            return 2

        async def show(store: Store) -> int:
            view = await store.queries.session(tid)
            if view is None:
                print(f"tokend sessions: no session {tid}", file=sys.stderr)
                return 1
            print(json.dumps(view.as_json()))
            return 0

        return with_store("sessions", settings, show)

    async def listing(store: Store) -> int:
        cursor: str | None = ""
        printed = 0
        while cursor is not None and (args.limit is None or printed < args.limit):
            page_size = min(LIST_PAGE, args.limit - printed) if args.limit else LIST_PAGE
            page, cursor = await store.queries.sessions(args.state, cursor, page_size)
            for view in page:
                print(json.dumps(view.as_json()))
            printed += len(page)
        if not printed:  # said on stderr: stdout stays one JSON object per line
            where = f" in state {args.state}" if args.state else ""
            print(f"tokend sessions: no live sessions{where}", file=sys.stderr)
        return 0

    return with_store("sessions", settings, listing)
