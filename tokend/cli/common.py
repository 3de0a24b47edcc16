"""What the commands of ``tokend`` share: setting groups, the event loop, the store."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from tokend.config import Settings

if TYPE_CHECKING:
    from tokend.store.sessions import Store
    from tokend.tokens.service import TokenService

# Groups of settings the commands read (each declares its own SETTINGS from these);
# every one can also come from TOKEND_* or the config file.
KEYS = ("keys_dir", "data_dir", "key_publish_delay", "token_ttl", "leeway")
MINT = (*KEYS, "issuer", "audience")
REDIS = ("redis_url", "data_dir", "key_prefix", "redis_timeout")
LOGS = ("log_format", "log_level")


def run_async(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def redis_url(settings: Settings) -> str:
    from tokend.ops.embedded import socket_url

    return settings.redis_url or socket_url(settings.resolved_data_dir)


def unreachable(command: str, settings: Settings, error: BaseException) -> str:
    """The one line a command prints when the server's Redis does not answer: what it
    tried (the embedded server's socket in the data directory, or the URL, its password
    hidden), why, and what to check."""
    from tokend.logs import redact_url

    why = str(error) or type(error).__name__
    if settings.redis_url:
        return (
            f"tokend {command}: cannot reach Redis at {redact_url(settings.redis_url)} "
            f"({why}); check TOKEND_REDIS_URL"
        )
    return (
        f"tokend {command}: cannot reach the embedded Redis of data directory "
        f"{settings.resolved_data_dir} ({why}); is tokend serve running with this data "
        "directory? Give the server's TOKEND_DATA_DIR, or its TOKEND_REDIS_URL"
    )


def parse_tid(command: str, text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        print(f"tokend {command}: not a token id (UUID): {text}", file=sys.stderr)
        return None


def with_store(command: str, settings: Settings, use: Callable[[Store], Awaitable[int]]) -> int:
    """Run ``use`` on a store over the configured Redis (the embedded one's socket when
    redis_url is empty); exit status 1 when Redis is unreachable."""
    from tokend.store.redis_client import open_client
    from tokend.store.sessions import Store
    from tokend.store.unavailable import StoreUnavailable

    async def main() -> int:
        redis = open_client(redis_url(settings), settings)
        try:
            return await use(Store(redis, settings, settings.resolved_node_name))
        finally:
            await redis.aclose()

    try:
        return asyncio.run(main())
    except StoreUnavailable as exc:
        print(unreachable(command, settings, exc.__context__ or exc), file=sys.stderr)
        return 1


def token_service(command: str, settings: Settings) -> TokenService:
    """The tokens of the configured keys directory. One without a key gets a new key ring,
    whose tokens only a server of the same directory accepts: said on stderr, since a
    shell without the server's settings reaches another directory."""
    from tokend.tokens.keys import KID_PATTERN, KeyRing
    from tokend.tokens.service import TokenService

    directory = settings.resolved_keys_dir
    existing = directory.is_dir() and any(
        KID_PATTERN.match(path.stem) for path in directory.glob("*.pem")
    )
    tokens = TokenService(settings, KeyRing.open(directory))
    if not existing:
        print(
            f"tokend {command}: no signing key in {directory}: made a new key ring. A server "
            "with other keys refuses these tokens (4501 unknown_kid): give this command the "
            "server's TOKEND_DATA_DIR or TOKEND_KEYS_DIR",
            file=sys.stderr,
        )
    return tokens
