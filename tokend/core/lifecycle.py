"""Session clocks: the ACTIVE / WARN / EXPIRED state machine, as pure functions.

Implements the spec's "Session states and clocks". Every function takes the
current time as an argument, so tests drive it with a fake clock.

This is the reference the server's decisions are held to: they are made in Redis,
on Redis ``TIME`` (so that no node's own clock decides an expiry), by
``heartbeat.lua`` when it records a heartbeat, ``hello.lua`` when it resumes a session
(and decides whether another connection holds it live), ``release.lua`` when a
connection that held its session ended, and ``sweep.lua`` when a sweep judges due
sessions; ``tests/test_clocks.py`` tests these rules and ``tests/test_lua_contract.py``
holds those scripts to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    ACTIVE = "ACTIVE"
    WARN = "WARN"
    EXPIRED = "EXPIRED"


class ExpiryReason(StrEnum):
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    TOKEN_EXPIRED = "token_expired"


@dataclass(frozen=True, slots=True)
class Clocks:
    """The two heartbeat clocks, in milliseconds; ``warn_after < expire_after``."""

    warn_after_ms: int
    expire_after_ms: int

    def __post_init__(self) -> None:
        if not 0 < self.warn_after_ms < self.expire_after_ms:
            raise ValueError("clocks need 0 < warn_after < expire_after")


@dataclass(frozen=True, slots=True)
class Transition:
    """A state change that is due: the new state and, for EXPIRED, why."""

    to: State
    reason: ExpiryReason | None = None


def deadline(state: State, last_heartbeat_ms: int, exp_ms: int, clocks: Clocks) -> int:
    """The time at which :func:`due_transition` next returns a transition.

    An ACTIVE session is next due at its WARN time, a WARN session at its
    EXPIRED time; either way no later than the token's own expiry.
    """
    if state is State.ACTIVE:
        return min(last_heartbeat_ms + clocks.warn_after_ms, exp_ms)
    if state is State.WARN:
        return min(last_heartbeat_ms + clocks.expire_after_ms, exp_ms)
    raise ValueError("an EXPIRED session has no deadline")


def due_transition(
    state: State, last_heartbeat_ms: int, exp_ms: int, now_ms: int, clocks: Clocks
) -> Transition | None:
    """What the session must become at ``now_ms``, or None if nothing is due.

    A session silent for ``expire_after`` expires even if it was never marked
    WARN (the sweep was late): it does not pass through WARN on its way out.
    """
    if state is State.EXPIRED:
        return None
    if now_ms >= exp_ms:
        return Transition(State.EXPIRED, ExpiryReason.TOKEN_EXPIRED)
    silent_ms = now_ms - last_heartbeat_ms
    if silent_ms >= clocks.expire_after_ms:
        return Transition(State.EXPIRED, ExpiryReason.HEARTBEAT_TIMEOUT)
    if state is State.ACTIVE and silent_ms >= clocks.warn_after_ms:
        return Transition(State.WARN)
    return None


def parked_heartbeat(
    state: State, last_heartbeat_ms: int, exp_ms: int, now_ms: int, clocks: Clocks
) -> int | None:
    """The heartbeat time a session's clocks run from once the server itself closed its
    connection with 1001 (a planned close: drain, reload, shutdown), or None when they
    keep running from the last one (docs/protocol.md §5, "Planned close").

    A session ACTIVE with nothing due is *parked*: the close counts as its heartbeat, and
    its clocks are then held for as long as a restart takes (:func:`parked_hold`). A
    session in WARN, or one already due (its client was silent before the close; a sweep
    would make it WARN or EXPIRED), keeps its clocks and is not parked.
    """
    if state is not State.ACTIVE:
        return None
    if due_transition(state, last_heartbeat_ms, exp_ms, now_ms, clocks) is not None:
        return None
    return now_ms


def parked_hold(last_resume_ms: int, serving_since_ms: int, window_ms: int) -> int:
    """Until when a parked session that falls due is held, neither warned nor expired: a
    restart is under way while parked sessions of its shard are being resumed, or a
    node began serving, within ``window_ms`` (``warn_after``: the silence tokend
    tolerates from any client). ``last_resume_ms`` is the last resume of a parked session
    of the shard (0: none), ``serving_since_ms`` when the sweeping node began sweeping.

    Once the hold has passed, the session is parked no more: its clocks run again from
    the end of the hold (:func:`unparked_heartbeat`), as if it had heartbeat then. So a
    session whose client never comes back ends at the latest ``expire_after`` after its
    shard's restart stopped resuming sessions, and never after its token's exp.
    """
    return max(last_resume_ms, serving_since_ms) + window_ms


def unparked_heartbeat(last_heartbeat_ms: int, hold_ms: int) -> int:
    """The heartbeat time a parked session's clocks run from once its hold has passed."""
    return max(last_heartbeat_ms, hold_ms)


# Spec "Resume proof" (revision 2): how much older than one heartbeat interval the last
# valid heartbeat (or WELCOME) of the connection holding a session may be, and the session
# still held live by it. The spec fixes it at 15 s: a heartbeat late by that much (a busy
# client, a slow network) still keeps a thief without the resume proof out.
HELD_LIVE_SLACK_MS = 15_000


def held_live_ms(heartbeat_interval_ms: int) -> int:
    """How long after its last heartbeat (or WELCOME) a connection holds its session live."""
    return heartbeat_interval_ms + HELD_LIVE_SLACK_MS


def held_live(held: bool, last_heartbeat_ms: int, now_ms: int, heartbeat_interval_ms: int) -> bool:
    """Spec "Resume proof": whether a connection holds the session live, so that a HELLO
    without a valid resume proof cannot take it (close 4509). ``held``: a connection holds
    the session (none once its connection ended: ``release.lua``); it must have heartbeat
    (or been WELCOMEd) at most :func:`held_live_ms` ago."""
    return held and now_ms - last_heartbeat_ms <= held_live_ms(heartbeat_interval_ms)


def resume_outlasted(heartbeat_interval_ms: int, expire_after_ms: int) -> bool:
    """Whether a session can expire while a connection that went away unseen (no FIN: a
    cut, a client that lost its WELCOME) still holds it live: its client, without the
    resume proof, is refused 4509 until then, and may find it expired. Never so with the
    defaults (30 s + 15 s against 120 s)."""
    return held_live_ms(heartbeat_interval_ms) >= expire_after_ms


def off_redis_leave_after_ms(heartbeat_interval_ms: int, clocks: Clocks) -> int:
    """How long a node cut from Redis alone acknowledges a connection's heartbeats
    unstored before it closes that connection 1013 for its client to resume on a node
    that reaches Redis (docs/protocol.md §6, setting ``off_redis``), counted from the
    first heartbeat it could not store.

    The rest of the cluster judges the session by its last heartbeat stored, one
    interval before that: the node lets go halfway from its WARN to its EXPIRED there.
    That is long past a Redis failover, whose outage every node sees at once and which
    the replay of the held heartbeats covers, and leaves half of that stretch for the
    client's resume elsewhere."""
    return (clocks.warn_after_ms + clocks.expire_after_ms) // 2 - heartbeat_interval_ms


# Ranks run 0..RANKS-1.
RANKS = 20


def serving_rank(prio: int, warned: bool) -> int:
    """Order in which sessions are served under overload: lowest first.

    Higher token ``prio`` first; a session in WARN after every ACTIVE one (spec
    "Session state machine": QoS degraded in WARN). Waiting heartbeats are stored in
    this order, and a node sheds load from the other end (:mod:`tokend.server.shedding`).
    """
    return (10 if warned else 0) + 9 - prio


def shed_classes(shed_from: int) -> str:
    """The sessions ranked ``shed_from`` or worse, in words (for logs)."""
    if shed_from >= RANKS:
        return "none"
    if shed_from >= 10:
        return f"WARN sessions of prio <= {RANKS - 1 - shed_from}"
    return f"every WARN session, ACTIVE ones of prio <= {9 - shed_from}"
