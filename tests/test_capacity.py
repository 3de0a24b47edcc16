"""Server fixes found by the capacity runs (load_tests/soak.py), each on a real Redis."""

from __future__ import annotations

from tests.support import EventLog
from tokend.store import Store

from .test_store import control, started, store

__all__ = ["control", "store"]  # fixtures, shared with test_store


async def test_a_resume_on_a_connection_of_the_same_id_closes_nothing(
    store: Store, control: dict[str, EventLog]
) -> None:
    """A restarted node counts its connections afresh: a session resumed there may get
    the id of the connection it was held on before the restart (at 75,000 sessions over
    4 workers, about one does). That connection is this one: it must not be closed."""
    tid = await started(store, "node-a/1")
    resumed = await store.hello(tid, "alice", 5, 0, 0, "node-a/1")
    assert resumed.outcome == "resumed"
    for conn in ("node-a/2", "node-a/3"):  # real takeovers, each closing the one before
        await store.hello(tid, "alice", 5, 0, 0, conn)
    log = control["node-a"]
    await log.wait_until(lambda: len(log.events) >= 2)  # messages arrive in order
    assert [(m["op"], m["conn"], m["code"]) for m in log.events] == [
        ("close", "node-a/1", 4507),
        ("close", "node-a/2", 4507),
    ]
