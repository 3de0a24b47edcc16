"""``tokend keys``: show or rotate the signing keys."""

from __future__ import annotations

import argparse
import json
import sys

from tokend.cli.common import KEYS, LOGS
from tokend.config import Settings

# The settings `tokend keys` reads; its --help shows these alone.
SETTINGS: tuple[str, ...] = (*KEYS, *LOGS)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "keys",
        help="show or rotate signing keys",
        description="'show' prints the JWKS as served; 'rotate' adds a key, published "
        "by every node within a second, that signs after key_publish_delay (older keys "
        "keep verifying until their tokens have expired).",
    )
    parser.add_argument("action", choices=("show", "rotate"))
    parser.set_defaults(func=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    import time

    from tokend.tokens.keys import KeyRing
    from tokend.tokens.service import TokenService

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
