"""Load shedding: a node that falls behind refuses its least important sessions first.

A node is overloaded when its event loop runs late (the mean lateness of a timer,
sampled every :data:`TICK` over a :data:`WINDOW`, above the ``shed_lag`` setting) or
when more heartbeats wait than one Redis round trip takes (``heartbeat_batch``).
While it is, it sheds one more class of the sessions it holds per window, in the
order of :func:`tokend.core.lifecycle.serving_rank` from the worst: lowest ``prio`` first,
sessions in WARN before every ACTIVE one. It never sheds the best-ranked class it
holds: shedding protects the sessions that matter most, it does not stop serving. A
node whose sessions all rank alike (every token at the default ``prio``) therefore
sheds nothing but sessions in WARN.

What is shed is left unanswered, not closed (spec "Shedding without closing", revision
3): a heartbeat of a shed session that comes faster than the cadence (less than half an
interval after the last one recorded) is checked, its seq consumed, and neither recorded
nor answered (``Session.receive_heartbeat``); the connection stays. A heartbeat at the
cadence is always recorded and answered, so shedding never expires a client that keeps
its cadence. The node keeps counting what it leaves unanswered (:meth:`Shedder.shed_heartbeat`):
a class is served again only once its unanswered heartbeats, answered again, would fit in
half of what the node recorded when it fell behind (:meth:`Shedder.returning_fits`), so
that calm means the flood is over, not that shedding it made the loop punctual. A HELLO
whose token ranks among the shed classes is closed with 1013 (try again later; the
session, if it exists, is not touched; the client resumes it after its backoff).
Handshakes go on while some class is still served below the best: their HELLO decides,
by the token's ``prio``, so that the clients of classes not shed get back in. Once every
class but the best is shed and the node is still overloaded (:attr:`Shedder.saturated`),
new handshakes get HTTP 503 with Retry-After too (the token, and so its ``prio``, comes
only after the handshake; answering 503 costs less than a handshake and a token check),
and a connection whose heartbeat is left unanswered is not read for ``shed_pause``
seconds, never past half an interval after its last recorded heartbeat
(``SessionLink._shed``; with ``shed_pause`` 0 it is closed with 1013). After calm
windows for :data:`CALM_FOR`, the last class shed is served again, and so on back up.
A node that must shed again soon after it served a class again (within
:data:`RELAPSE_WITHIN`) waits twice as long before the next step up, up to
:data:`MAX_CALM_FOR`: a flood that outlasts the calm no longer swings the node between
serving it and shedding it, each swing a second of lateness for every session
(load_tests/overload.py: the shedding ended and began again every 2-5 s for a minute).

While the node sheds, a HELLO's claims are checked before its signature: one of a
shed class is refused without an Ed25519 verify (``Session._hello``). A client just
shed comes back at once if it does not honour the 1013's backoff, and each return costs
a handshake and that check before its HELLO is shed again. :class:`Penalties` refuses
it sooner for ``shed_penalty`` seconds: by source address with HTTP 503 and Retry-After
before the WebSocket handshake, and by ``sub`` with 1013 at HELLO before the token is
checked (the ``sub`` read from the unverified payload; only the shed of a session whose
signature was checked adds a ``sub`` penalty, so a forged ``sub`` refuses only its
sender, by its own address). A penalty ends early once its class is served again.

The decision is an input of the session core (``Session.receive(frame, shed_from)``);
this module only decides where ``shed_from`` stands.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import time
from collections.abc import Callable, Iterable

import structlog

from tokend.core.lifecycle import RANKS, serving_rank, shed_classes

log = structlog.get_logger("tokend.shedding")

# How often the loop's lateness is sampled, and how many seconds of samples decide
# one step: a single long iteration (a GC pass) does not make a node shed.
TICK = 0.01
WINDOW = 0.2
# Calm (mean lateness under half of shed_lag, no heartbeat backlog) for this long
# before a shed class is served again.
CALM_FOR = 1.0
# A step down this soon after a step up is a relapse: the calm it takes doubles, up to
# MAX_CALM_FOR. A step down later than that starts over from CALM_FOR.
RELAPSE_WITHIN = 10.0
MAX_CALM_FOR = 30.0
# How long the classes held, read from every session (a rank each, on a loop already
# late), are taken as they were: they change slower than one window.
HELD_FOR = 1.0


class Shedder:
    """Where a node's shedding stands: sessions ranked ``shed_from`` or worse are shed.

    ``ranks`` gives the rank of every session the node holds (read only when a step
    down is decided); ``backlogged`` tells whether heartbeats wait beyond one batch.
    """

    def __init__(
        self,
        shed_lag: float,
        ranks: Callable[[], Iterable[int]],
        backlogged: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
        recorded: Callable[[], int] = int,
    ) -> None:
        self.shed_lag = shed_lag
        self.ranks = ranks
        self.backlogged = backlogged
        self.clock = clock
        # Heartbeats recorded (answered) so far, a running count; read once per window.
        self.recorded = recorded
        self._recorded_before = 0
        # Heartbeats left unanswered in the window under way, by the session's rank
        # (SessionLink counts them), and those of the window before, per second: the
        # load each shed class would bring back if served again.
        self.shed_now = [0] * RANKS
        self.shed_per_s = [0.0] * RANKS
        self.recorded_per_s = 0.0
        # Heartbeats per second recorded in the windows that found the node overloaded
        # (the most of them), in this episode of shedding: what it could not take.
        self.capacity = 0.0
        self.shed_in_episode = 0
        self._held: set[int] = set()
        self._held_at = -math.inf
        self.shed_from = RANKS
        # Every class but the best is shed, and the node was overloaded still.
        self.saturated = False
        self._steps: list[int] = []  # the levels stepped down from, to go back up
        # How long the loop must be calm before the next step up (see the module), and
        # when the last step up was.
        self.calm_for = CALM_FOR
        self._stepped_up_at = -math.inf

    @property
    def active(self) -> bool:
        return self.shed_from < RANKS

    async def run(self, running: Callable[[], bool]) -> None:
        """Sample the loop's lateness and step the shedding level, while ``running()``."""
        loop = asyncio.get_running_loop()
        late, samples = 0.0, 0
        window_end = loop.time() + WINDOW
        calm_since: float | None = None
        while running():
            expected = loop.time() + TICK
            await asyncio.sleep(TICK)
            now = loop.time()
            late += max(0.0, now - expected)
            samples += 1
            if now < window_end:
                continue
            lag = late / samples
            self.window_ended(now - window_end + WINDOW)
            late, samples, window_end = 0.0, 0, now + WINDOW
            if lag > self.shed_lag or self.backlogged():
                calm_since = None
                self.step_down(lag, steps_for(lag, self.shed_lag))
            elif lag > self.shed_lag / 2 or not self.returning_fits():
                calm_since = None
            elif calm_since is None:
                calm_since = now
            elif now - calm_since >= self.calm_for and self._steps:
                calm_since = now
                self.step_up()

    def shed_heartbeat(self, rank: int) -> None:
        """A heartbeat of a session ranked ``rank`` was left unanswered."""
        self.shed_now[rank] += 1

    def window_ended(self, seconds: float) -> None:
        """Take the window's counts (``seconds`` long) as the rates the next steps judge."""
        recorded = self.recorded()
        self.recorded_per_s = (recorded - self._recorded_before) / seconds
        self._recorded_before = recorded
        shed = self.shed_now
        self.shed_in_episode += sum(shed)
        self.shed_per_s = [n / seconds for n in shed]
        self.shed_now = [0] * RANKS

    def returning_fits(self) -> bool:
        """Whether the class shed last, served again, would bring back no more than half
        of what the node recorded when it fell behind (with what it records now): a node
        that sheds a flood keeps seeing it, and calm means the flood is over, not that
        shedding it made the loop punctual. Nothing shed to bring back always fits."""
        if not self._steps:
            return True
        back = sum(self.shed_per_s[self.shed_from : self._steps[-1]])
        return not back or self.recorded_per_s + back <= self.capacity / 2

    def step_down(self, lag: float, steps: int = 1) -> None:
        """Shed the ``steps`` worst-ranked classes held that are not shed yet, never the
        best one."""
        self.capacity = max(self.capacity, self.recorded_per_s)
        held = self.held()
        if not held:
            return
        best = min(held)
        worse = sorted((rank for rank in held if best < rank < self.shed_from), reverse=True)
        if not worse:
            if self.active and not self.saturated:
                self.saturated = True
                log.warning("overloaded: refusing new handshakes", lag_ms=round(lag * 1000))
            return
        relapse = self.clock() - self._stepped_up_at < RELAPSE_WITHIN
        self.calm_for = min(2 * self.calm_for, MAX_CALM_FOR) if relapse else CALM_FOR
        for rank in worse[:steps]:
            self._steps.append(self.shed_from)
            self.shed_from = rank
        log.warning(
            "overloaded: shedding sessions",
            shed=shed_classes(self.shed_from),
            lag_ms=round(lag * 1000),
            calm_for_s=self.calm_for,
        )

    def held(self) -> set[int]:
        """The ranks of the sessions held, read again at most every :data:`HELD_FOR`."""
        now = self.clock()
        if now - self._held_at >= HELD_FOR:
            self._held, self._held_at = set(self.ranks()), now
        return self._held

    def step_up(self) -> None:
        """Serve the class shed last again (and new handshakes)."""
        self.saturated = False
        self._stepped_up_at = self.clock()
        self.shed_from = self._steps.pop()
        if self.active:
            log.info("shedding fewer sessions", shed=shed_classes(self.shed_from))
        else:
            log.info("shedding ended", unanswered_heartbeats=self.shed_in_episode)
            self.capacity = 0.0
            self.shed_in_episode = 0


def steps_for(lag: float, shed_lag: float) -> int:
    """How many classes one window sheds: one, and one more for each doubling of the
    lateness past ``shed_lag``. A flood or a connect storm that just began makes the loop
    many times later than that: the classes it takes to get back under are shed in one
    window, not in as many windows, each of which every session waits out."""
    return 1 + max(0, int(math.log2(lag / shed_lag))) if lag > shed_lag > 0 else 1


# Penalised clients held at which the expired entries are swept out (then twice the
# count left): the tables stay bounded by the clients shed within one penalty.
PRUNE_AT = 1024


class Penalties:
    """Clients shed a moment ago, refused for ``seconds`` before they cost a handshake
    (by source address) or a token check (by ``sub``).

    Each penalty keeps the rank the client's HELLO would have (its ``prio``, ACTIVE): it
    holds only while the shedder still sheds that rank, so it ends early once the class
    is served again.
    """

    def __init__(
        self, seconds: float, shedder: Shedder, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.seconds = seconds
        self.shedder = shedder
        self.clock = clock
        # key -> (until, rank): one table per address, one per sub.
        self.by_ip: dict[str, tuple[float, int]] = {}
        self.by_sub: dict[str, tuple[float, int]] = {}
        self._prune_at = PRUNE_AT

    def add(self, ip: str | None, sub: str | None, prio: int) -> None:
        """A session from ``ip`` was shed (close 1013); ``sub`` when its token was
        verified (None: a HELLO shed before its signature was checked)."""
        if not self.seconds:
            return
        entry = (self.clock() + self.seconds, serving_rank(prio, warned=False))
        if ip is not None:
            self.by_ip[ip] = entry
        if sub is not None:
            self.by_sub[sub] = entry
        if len(self.by_ip) + len(self.by_sub) >= self._prune_at:
            self._prune()

    def retry_after(self, ip: str) -> int | None:
        """Whole seconds (at least 1) a client from ``ip`` must wait, or None: admitted."""
        left = self._left(self.by_ip, ip)
        return max(1, math.ceil(left)) if left is not None else None

    def refuses(self, token: str) -> bool:
        """Whether a HELLO carrying ``token`` is refused by its ``sub``'s penalty. The
        token is not verified here: a forged one names a penalised ``sub`` only to be
        refused itself (the penalty was added by a verified session, and stays)."""
        if not self.by_sub:
            return False
        sub = unverified_sub(token)
        return sub is not None and self._left(self.by_sub, sub) is not None

    def _left(self, table: dict[str, tuple[float, int]], key: str) -> float | None:
        entry = table.get(key)
        if entry is None:
            return None
        until, rank = entry
        left = until - self.clock()
        if left <= 0 or rank < self.shedder.shed_from:  # over, or the class served again
            del table[key]
            return None
        return left

    def _prune(self) -> None:
        now, shed_from = self.clock(), self.shedder.shed_from
        for table in (self.by_ip, self.by_sub):
            over = [k for k, (until, rank) in table.items() if until <= now or rank < shed_from]
            for key in over:
                del table[key]
        self._prune_at = max(PRUNE_AT, 2 * (len(self.by_ip) + len(self.by_sub)))


def unverified_sub(token: str) -> str | None:
    """The ``sub`` claim of a compact JWS's payload (RFC 7515 7.1), not verified; None
    when it cannot be read (the token check then refuses the token as it would)."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    payload = parts[1]
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (binascii.Error, ValueError):
        return None
    sub = claims.get("sub") if isinstance(claims, dict) else None
    return sub if isinstance(sub, str) else None
