"""The one poll loop: wait for state that offers nothing to await (another process's,
Redis's, a counter), bounded, failing with what was awaited."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


def _failure(what: str, check: Callable[[], object], timeout: float, last: object) -> str:
    name = what or getattr(check, "__qualname__", repr(check))
    return f"not reached within {timeout:g} s: {name} (last: {last!r})"


@overload
async def eventually(
    check: Callable[[], Awaitable[T | None]],
    timeout: float = ...,
    *,
    interval: float = ...,
    what: str = ...,
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T | None],
    timeout: float = ...,
    *,
    interval: float = ...,
    what: str = ...,
) -> T: ...


async def eventually(
    check: Callable[[], Any],
    timeout: float = 5.0,
    *,
    interval: float = 0.02,
    what: str = "",
) -> Any:
    """Call ``check`` (a function or a coroutine function) every ``interval`` seconds
    until its result is truthy, and return that result.

    Raises :class:`TimeoutError` naming ``what`` (or the check) and its last result
    after ``timeout`` seconds; an exception from ``check`` ends the wait at once, so a
    check can fail fast (a process that exited).
    """
    last: object = None
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            while True:
                result = check()
                last = await result if inspect.isawaitable(result) else result
                if last:
                    return last
                await asyncio.sleep(interval)
    except TimeoutError:
        if deadline.expired():
            raise TimeoutError(_failure(what, check, timeout, last)) from None
        raise


def eventually_sync(
    check: Callable[[], T], timeout: float = 5.0, *, interval: float = 0.02, what: str = ""
) -> T:
    """:func:`eventually` for code that blocks (fixtures, process start-up): the same
    contract, sleeping between calls."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() >= deadline:
            raise TimeoutError(_failure(what, check, timeout, result))
        time.sleep(interval)
    return result
