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
        print(f"tokend {command}: redis unavailable ({exc})", file=sys.stderr)
        return 1
