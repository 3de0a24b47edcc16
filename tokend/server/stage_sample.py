"""One heartbeat timed through its stages, for the stage histogram and the dashboard.

One message in :data:`tokend.metrics.STAGE_SAMPLE_EVERY` is sampled
(``Metrics.until_sample``); a sampled heartbeat's link takes a :class:`StageSample` and
marks the end of each stage of :data:`tokend.metrics.STAGES` as its heartbeat passes
it: decoded and verified (the session's), stored (the node's batch flush), sent (its
ACK written). The other heartbeats pay for none of it but the count.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokend.metrics import Metrics


class StageSample:
    """The ``time.perf_counter()`` readings of one sampled heartbeat: received (when
    made), then the end of each stage."""

    __slots__ = ("decoded", "received", "stored", "verified")

    def __init__(self) -> None:
        self.received = time.perf_counter()
        self.decoded = self.verified = self.stored = 0.0

    def decode_ended(self) -> None:
        self.decoded = time.perf_counter()

    def verify_ended(self) -> None:
        self.verified = time.perf_counter()

    def store_ended(self) -> None:
        self.stored = time.perf_counter()

    def send_ended(self, metrics: Metrics) -> None:
        """The ACK is written: the sample goes into ``metrics``."""
        readings = (self.received, self.decoded, self.verified, self.stored, time.perf_counter())
        metrics.stages(readings)
