"""``tokend issue``: mint tokens with the server's keys (no Redis)."""

from __future__ import annotations

import argparse
import sys

from tokend.cli.common import LOGS, MINT, token_service
from tokend.config import Settings

# The settings `tokend issue` reads; its --help shows these alone.
SETTINGS: tuple[str, ...] = (*MINT, *LOGS)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "issue",
        help="mint tokens with the server's keys",
        description="Print a token for SUB, or with --count N one token per line for "
        "SUB-1 .. SUB-N. Uses the keys directory only; no Redis needed.",
    )
    parser.add_argument("--sub", required=True, help="subject (user) of the token")
    parser.add_argument("--ttl", type=int, help="lifetime in seconds (default: token_ttl)")
    parser.add_argument(
        "--prio",
        type=int,
        default=5,
        choices=range(10),
        metavar="0..9",
        help="priority claim (default 5)",
    )
    parser.add_argument("--count", type=int, help="mint N tokens, SUB-1 .. SUB-N")
    parser.set_defaults(func=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    tokens = token_service("issue", settings)
    if args.count is None:
        print(tokens.mint(args.sub, ttl_s=args.ttl, prio=args.prio))
        return 0
    out = sys.stdout
    for n in range(1, args.count + 1):
        out.write(tokens.mint(f"{args.sub}-{n}", ttl_s=args.ttl, prio=args.prio) + "\n")
    return 0
