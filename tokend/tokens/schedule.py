"""When each signing key signs and while it is published (:class:`KeySchedule`), from
the kids alone, so that every node sharing the keys directory agrees."""

from __future__ import annotations

import bisect
import calendar
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokend.config import Settings


@functools.cache
def _created(kid: str) -> float:
    """The end of the second a kid names (UTC ``YYYYmmddTHHMMSSZ``): its key was
    created no later."""
    fields = (kid[0:4], kid[4:6], kid[6:8], kid[9:11], kid[11:13], kid[13:15])
    return calendar.timegm(tuple(map(int, fields))) + 1.0


@dataclass(frozen=True, slots=True)
class KeySchedule:
    """When each key signs and while it is published, from the kids alone (the second
    each names) and two settings, so that every node sharing the directory agrees.

    A new key is published at once, and signs once ``publish_delay`` has passed, by
    when every JWKS cached before it (for at most ``jwks_max_age`` < the delay) has
    expired. Before that the key before it goes on signing (the oldest, while none is
    due). A key that stopped signing stays published ``retire_after`` (token_ttl +
    leeway), until every token it signed has expired, and then neither is published
    nor verifies.
    """

    publish_delay: float
    retire_after: float

    @classmethod
    def of(cls, settings: Settings) -> KeySchedule:
        return cls(settings.key_publish_delay, settings.token_ttl + settings.leeway)

    def signs_from(self, kid: str) -> float:
        return _created(kid) + self.publish_delay

    def signing(self, kids: Sequence[str], now: float) -> str:
        """The kid that signs at ``now`` (``kids`` oldest first, not empty)."""
        due = [kid for kid in kids if self.signs_from(kid) <= now]
        return due[-1] if due else kids[0]

    def retires_at(self, kid: str, kids: Sequence[str]) -> float:
        """When ``kid`` (one of ``kids``, oldest first) stops being published."""
        newer = bisect.bisect_right(kids, kid)
        if newer == len(kids):
            return math.inf
        return self.signs_from(kids[newer]) + self.retire_after

    def published(self, kids: Sequence[str], now: float) -> list[str]:
        """The kids published (and verifying) at ``now``: all but the retired."""
        return [kid for kid in kids if now < self.retires_at(kid, kids)]
