"""The store's answers to a session, as the session core sees them: enums and tuples.

This is the narrow interface between :mod:`tokend.session` (pure protocol logic) and
:mod:`tokend.store` (Redis): no key, script name or raw reply crosses it. The store
turns each script's reply into one of these; the session decides what it means for
the connection.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import NamedTuple

from tokend.clocks import ExpiryReason


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
    """One heartbeat's outcome; a tuple: made per heartbeat, at a tenth of a dataclass' cost."""

    outcome: HeartbeatOutcome
    was_warn: bool = False
    renewed: bool = False
    exp_ms: int = 0
    iat_s: int = 0  # 0: unchanged (only a renewal changes it)
    ended: Ended | None = None


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
    """What a sweep made of a claimed session (transition.lua)."""

    WARN = "warn"
    TOKEN_EXPIRED = ExpiryReason.TOKEN_EXPIRED.value
    HEARTBEAT_TIMEOUT = ExpiryReason.HEARTBEAT_TIMEOUT.value
    GONE = "gone"  # vanished unswept: its hash expired before any sweep judged it
