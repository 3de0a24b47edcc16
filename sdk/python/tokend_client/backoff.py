"""How long a client waits before its next connection attempt: full-jitter exponential
backoff, the spread first reconnect after a close 1001, and ``Retry-After``.

Pure: no I/O, no clock. :mod:`tokend_client.core` asks it for each wait; the load
generators (load_tests/locustfile.py through the core, bench/loadgen.py directly) wait
the same way.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Backoff:
    """Full-jitter exponential backoff between reconnect attempts.

    Attempt ``n`` (0 for the first retry) waits ``uniform(0, min(cap, base * 2**n))``
    seconds. The count starts again once a connection has had a heartbeat
    acknowledged. ``max_attempts`` bounds failed attempts in a row (None: retry
    for as long as the failures are reconnectable; a terminal code always stops).

    Two refusals say more than "try again" and are waited out longer, so that the
    clients of a restarting server do not come back all at once:

    - a close 1001 (the server drains, reloads or stops: all its clients at once)
      waits ``uniform(0, going_away_window)`` (:meth:`after_going_away`);
    - an HTTP 503 or 429 with ``Retry-After`` waits those seconds and more
      (:meth:`after_refusal`).

    ``draw(low, high)`` is the random draw of every wait (``random.uniform``); a test
    gives its own to see the bounds exactly.
    """

    base: float = 0.5
    cap: float = 30.0
    max_attempts: int | None = None
    going_away_window: float = 5.0
    draw: Callable[[float, float], float] = field(default=random.uniform, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap:
            raise ValueError("backoff needs 0 < base <= cap")
        if self.max_attempts is not None and self.max_attempts < 0:
            raise ValueError("max_attempts must be None or >= 0")
        if self.going_away_window < 0:
            raise ValueError("going_away_window must be >= 0")

    def ceiling(self, attempt: int) -> float:
        """The longest wait of attempt ``attempt``."""
        return min(self.cap, self.base * 2.0 ** min(attempt, 64))

    def delay(self, attempt: int) -> float:
        """A random wait for attempt ``attempt``, in seconds."""
        return self.draw(0.0, self.ceiling(attempt))

    def after_going_away(self, attempt: int, limit: float = float("inf")) -> float:
        """The wait after a close 1001: uniform over ``going_away_window`` (at most
        ``limit``: what the session can spare), or over the attempt's ceiling if longer."""
        return self.draw(0.0, max(min(self.going_away_window, limit), self.ceiling(attempt)))

    def after_refusal(self, attempt: int, retry_after: float) -> float:
        """The wait after an HTTP refusal that said ``Retry-After``: never sooner than its
        seconds, plus a random share of as long again (or of the attempt's ceiling, if
        longer) so that the clients refused together do not return together."""
        return retry_after + self.draw(0.0, max(retry_after, self.ceiling(attempt)))


class Cadence(Protocol):
    """A WELCOME's clocks, as :func:`going_away_limit` reads them."""

    @property
    def heartbeat_ms(self) -> int: ...

    @property
    def expire_ms(self) -> int: ...


def going_away_limit(welcome: Cadence) -> float:
    """The most seconds a first reconnect after 1001 may wait: half of what the session of
    ``welcome`` (a WELCOME) has left at worst when the close comes (expire_after, less the
    heartbeat interval it may already be behind), so that a spread reconnect cannot
    expire it."""
    return (welcome.expire_ms - welcome.heartbeat_ms) / 2000


def retry_after(value: str | None) -> float | None:
    """The seconds of a ``Retry-After`` header (RFC 9110 §10.2.3, delay-seconds; tokend
    sends those); None when absent or not a number of seconds (an HTTP-date)."""
    if value is None:
        return None
    value = value.strip()
    # isascii(): str.isdigit() also accepts digits such as "²" that int() refuses.
    return float(value) if value.isascii() and value.isdigit() else None
