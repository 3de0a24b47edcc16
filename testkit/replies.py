"""Redis replies as the tests' clients give them.

The clients decode (``decode_responses=True``), so a string or a hash field is ``str``;
redis-py types its replies and arguments for clients that decode and clients that do
not. These narrow a reply to what it is here, checking it on the way, and make a dict
a ``mapping`` argument (whose key type redis-py holds invariant).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from redis.typing import EncodableT


def text(reply: object) -> str:
    """A string reply: GET, or HGET of a field that is there."""
    assert isinstance(reply, str), reply
    return reply


def fields(reply: object) -> dict[str, str]:
    """A hash's fields: HGETALL."""
    assert isinstance(reply, dict), reply
    return reply


def mapping(values: Mapping[str, EncodableT]) -> Mapping[EncodableT, EncodableT]:
    """``values`` as the ``mapping`` of HSET."""
    return dict(values.items())


def entries(reply: object) -> list[tuple[str, dict[str, str]]]:
    """A stream's entries, each its id and its fields: XRANGE."""
    assert isinstance(reply, list), reply
    return reply


def address(reply: object) -> tuple[str, int]:
    """A host and port: SENTINEL GET-MASTER-ADDR-BY-NAME."""
    assert isinstance(reply, tuple), reply
    return reply


def rows(reply: object) -> list[dict[str, Any]]:
    """One dict per row: SENTINEL REPLICAS, SENTINEL SENTINELS, XPENDING with a range."""
    assert isinstance(reply, list), reply
    return reply
