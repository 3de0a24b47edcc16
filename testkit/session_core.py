"""The session core (tokend/core/session.py) driven by hand: its cadence, its node
(:class:`TokenNode`, a :class:`tokend.core.session.Node`) with real tokens, a session on a
fake clock, and the HELLO/WELCOME and HEARTBEAT a client would send. For
tests/test_session.py and the tests that drive the core the same way (load shedding,
capacity fixes).

The fixtures ``node`` and ``session`` need ``tokens`` and ``clock``
(:mod:`testkit.pure`); a test module imports all four.
"""

from __future__ import annotations

import time

import pytest

from testkit.pure import FakeClock
from tokend.core import protocol as p
from tokend.core import session as core_session
from tokend.core.claims import Claims
from tokend.core.session import Ask, Cadence, Session, Welcome
from tokend.core.store_messages import HelloAnswer, HelloOutcome
from tokend.tokens.service import TokenService

CADENCE = Cadence(heartbeat_ms=1_000, warn_ms=3_000, expire_ms=4_000, max_frame_rate=5)
IAT_S = int(time.time())  # at import: a whole run later, tokens minted then are still valid
SESSION_S = 3600
EXP_MS = (IAT_S + SESSION_S) * 1000  # the session's exp, as the store says it
SINCE_MS = IAT_S * 1000 + 7  # when the connection took the session, as the store says it


class TokenNode(core_session.Node):
    """A session's node with real tokens: verify and sign; a sub cap of ``full`` subs."""

    def __init__(self, tokens: TokenService) -> None:
        self.tokens = tokens
        self.full: set[str] = set()
        self.signed: list[Claims] = []

    def check(self, token: str, signature: bool) -> tuple[Claims, str]:
        return self.tokens.check(token, time.time(), signature=signature)

    def sign(self, claims: Claims, iat_s: int, exp_s: int) -> tuple[bytes, str]:
        self.signed.append(Claims(claims.tid, claims.sub, iat_s, exp_s, claims.prio))
        return self.tokens.reissue(claims, iat_s, exp_s)

    def sub_is_full(self, claims: Claims) -> bool:
        return claims.sub in self.full


@pytest.fixture
def node(tokens: TokenService) -> TokenNode:
    return TokenNode(tokens)


@pytest.fixture
def session(node: TokenNode, clock: FakeClock) -> Session:
    return Session(node, CADENCE, "node-a/1", clock)


def welcome(
    session: Session, tokens: TokenService, *, resumed: bool = False, ttl_s: int = SESSION_S
) -> p.Welcome:
    """HELLO with a fresh token for "alice" (its exp the session's unless ``ttl_s`` says
    otherwise), the store's answer; the WELCOME sent."""
    assert session.receive(p.Hello(tokens.mint("alice", ttl_s=ttl_s, iat=IAT_S))) is Ask.START
    outcome = HelloOutcome.RESUMED if resumed else HelloOutcome.STARTED
    out = session.started(HelloAnswer(outcome, EXP_MS, IAT_S, SINCE_MS))
    assert isinstance(out, Welcome)
    frame = p.decode(out.frame)
    assert isinstance(frame, p.Welcome)
    return frame


def heartbeat(
    w: p.Welcome, seq: int, exp_ms: int = EXP_MS, tid: bytes | None = None
) -> p.Heartbeat:
    return p.make_heartbeat(w.session_key, tid or w.tid, seq, exp_ms)
