"""Server fixes found by the capacity runs (load_tests/soak.py), each on a real Redis."""

from __future__ import annotations

import time

from testkit.events import EventLog
from testkit.pure import tokens
from testkit.session_core import CADENCE, EXP_MS, IAT_S, TokenNode, node
from testkit.stores import control, proof_of, started, store
from tokend.core import protocol as p
from tokend.core.session import Ask, Close, Session
from tokend.core.store_messages import HelloAnswer, HelloOutcome
from tokend.store.sessions import Store
from tokend.tokens.service import TokenService

__all__ = ["control", "node", "store", "tokens"]  # fixtures of testkit


async def test_a_resume_on_a_connection_of_the_same_id_closes_nothing(
    store: Store, control: dict[str, EventLog]
) -> None:
    """A restarted node counts its connections afresh: a session resumed there may get
    the id of the connection it was held on before the restart (at 75,000 sessions over
    4 workers, about one does). That connection is this one: it must not be closed."""
    tid = await started(store, "node-a/1")
    proof = proof_of("node-a/1")
    resumed = await store.hello(tid, "alice", 5, 0, 0, "node-a/1", proof, proof)
    assert resumed.outcome == "resumed"
    # Real takeovers, each closing the one before (live: with the proof of its key).
    for before, conn in (("node-a/1", "node-a/2"), ("node-a/2", "node-a/3")):
        taken = await store.hello(tid, "alice", 5, 0, 0, conn, proof_of(before), proof_of(conn))
        assert taken.outcome == "resumed"
    log = control["node-a"]
    await log.wait_until(lambda: len(log.events) >= 2)  # messages arrive in order
    assert [(m["op"], m["conn"], m["code"]) for m in log.events] == [
        ("close", "node-a/1", 4507),
        ("close", "node-a/2", 4507),
    ]


def test_a_hello_the_store_does_not_answer_in_time_is_1013(node: TokenNode, tokens: TokenService):
    """Under a reconnect storm a HELLO may wait long for the store; past hello_timeout
    the client has given up and reconnected, and this HELLO, stored later, would take
    the session over from the new connection: it is answered 1013 instead."""
    session = Session(node, CADENCE, "node-a/1", time.monotonic)
    assert session.receive(p.Hello(tokens.mint("alice", ttl_s=600))) is Ask.START
    assert session.hello_timed_out() == Close(p.CloseCode.TRY_AGAIN_LATER, "hello_unanswered")
    assert session.started(HelloAnswer(HelloOutcome.STARTED, EXP_MS, IAT_S)) is None
