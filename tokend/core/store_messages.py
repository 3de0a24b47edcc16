"""What a session asks of the store and the store's answers, as the session side sees them:
enums and tuples.

This is the narrow interface between :mod:`tokend.core.session` and :mod:`tokend.server.connection`
(pure protocol logic and its connection) and :mod:`tokend.store` (Redis): no key, script
name or raw reply crosses it. The store turns each script's reply into one of these; the
session decides what it means for the connection.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import NamedTuple

from tokend.core.lifecycle import ExpiryReason


class Ended(StrEnum):
    """Why a session ended, as its tombstone records it until its token's exp."""

    EXPIRED = "expired"
    REVOKED = "revoked"
    CLOSED = "closed"  # logged out with BYE


class HelloOutcome(StrEnum):
    STARTED = "started"
    RESUMED = "resumed"
    ENDED = "ended"  # a tombstone: the token's session ended (``HelloAnswer.ended`` says how)
    EXPIRED = "expired"  # the token's exp has passed
    MISMATCH = "mismatch"  # a live session of this tid belongs to another sub
    # Another connection holds the session live and the HELLO has no valid resume proof
    # (spec "Resume proof", revision 2): nothing was written.
    IN_USE = "in_use"
    # A HELLO sent without its token's signature checked, whose token is not the one the
    # session was last verified with (or no such session): verify it, then ask again.
    # Nothing was written (docs/security.md, "A resume skips the signature...").
    VERIFY = "verify"


class HelloAnswer(NamedTuple):
    outcome: HelloOutcome
    exp_ms: int = 0  # the session's current exp (a resumed one may be newer than the token's)
    iat_s: int = 0
    since_ms: int = 0  # Redis time at which this connection took the session
    ended: Ended | None = None


class HeartbeatOutcome(StrEnum):
    OK = "ok"  # stored
    GONE = "gone"  # no live session: ``ended`` says how, None when it vanished unrecorded
    TAKEN = "taken"  # another connection holds the session now


class HeartbeatAnswer(NamedTuple):
    """One heartbeat's outcome, unless it is a plain OK (see :data:`HeartbeatReply`)."""

    outcome: HeartbeatOutcome
    was_warn: bool = False
    renewed: bool = False
    exp_ms: int = 0
    iat_s: int = 0  # 0: unchanged (only a renewal changes it)
    ended: Ended | None = None


# The store's answer to a heartbeat: the common one, stored with nothing else changed (not
# renewed, not leaving WARN), is the session's exp_ms alone, as heartbeat.lua replies it (no
# object made per heartbeat); any other is a HeartbeatAnswer.
HeartbeatReply = HeartbeatAnswer | int


def heartbeat_outcome(reply: HeartbeatReply) -> HeartbeatOutcome:
    """The outcome of a heartbeat's reply."""
    return HeartbeatOutcome.OK if isinstance(reply, int) else reply.outcome


class HeartbeatRequest(NamedTuple):
    """A connection's heartbeat for the batch; built once per session (at WELCOME), reused.

    Small on purpose: every idle session keeps one. Its keys are made at each flush.
    """

    tid: str
    conn: str
    shard: int
    # The digest (tokend.tokens.service.token_digest) of a token this connection was given in an
    # ACK (a renewal, or a token re-sent) that the store does not keep yet: the one flight
    # after that ACK carries it, and heartbeat.lua keeps it with the session, so that the
    # next resume with that token skips the signature (hello.lua). "" the rest of the time.
    token: str = ""


class Known(NamedTuple):
    """What a live connection knows of its session: enough for heartbeat.lua to restore
    it should a failover have lost it (or lost this connection's resume of it)."""

    sub: str
    prio: int
    iat_s: int
    exp_ms: int
    since_ms: int  # Redis time at which this connection took the session (HELLO's answer)
    proof: bytes  # the resume proof this connection's session key makes


class EndOutcome(IntEnum):
    """What a BYE or a revocation did (end.lua)."""

    ALREADY_ENDED = 0  # no live session (for BYE: none of this connection's)
    ENDED = 1  # a live session was ended
    BARRED = 2  # no live session: only the tombstone was written, to bar the token


class ReleaseOutcome(IntEnum):
    """What the release of a session by a connection that ended did (release.lua)."""

    NOT_HELD = 0  # the connection no longer held the session (taken over, ended): nothing
    RELEASED = 1  # no connection holds the session now; its clocks run on
    PARKED = 2  # released after a planned close; clocks restarted (clocks.parked_heartbeat)


class Swept(StrEnum):
    """What a sweep made of a due session (sweep.lua)."""

    WARN = "warn"
    TOKEN_EXPIRED = ExpiryReason.TOKEN_EXPIRED.value
    HEARTBEAT_TIMEOUT = ExpiryReason.HEARTBEAT_TIMEOUT.value
    GONE = "gone"  # vanished unswept: its hash expired before any sweep judged it


class SweepAnswer(NamedTuple):
    """One sweep of every shard (sweep.lua): the transitions it made, each (tid, what, the
    connection of the sweeping node to warn or close, or ""), and what the next sweep
    needs to know."""

    now_ms: int  # Redis time at the sweep
    made: list[tuple[str, Swept, str]]
    next_due_ms: int | None  # the earliest deadline left in any shard (None: none left)
    full: bool  # a shard had as many due sessions as a sweep judges: more may be due now
