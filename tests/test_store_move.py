"""move.lua (tokend/store/sessions.py Store.moves): a rolling reload's handoff moves a
session from the old worker's connection to the new worker's in one atomic step, only
while the old connection still holds it, and emits nothing; a move back from a new worker
that died names that worker's node."""

from __future__ import annotations

import json
import uuid

from redis.asyncio import Redis

from testkit import replies
from testkit.stores import proof_of, started, store
from tokend.core.store_messages import HeartbeatOutcome
from tokend.store.sessions import MoveRequest, Store

__all__ = ["store"]  # a fixture of testkit


async def since_of(redis: Redis, store: Store, tid: uuid.UUID) -> int:
    return int(replies.text(await redis.hget(store.keys.session_keys(tid)[0], "since")))


async def test_a_session_moves_only_from_the_connection_that_holds_it(
    store: Store, redis: Redis
) -> None:
    held, taken = await started(store, "node-a/1"), await started(store, "node-a/2")
    await store.hello(taken, "alice", 5, 0, 2**31, "node-b/9", shown=proof_of("node-a/2"))
    fields_before = await redis.hgetall(store.keys.session_keys(held)[0])
    since = await since_of(redis, store, held)
    gone = uuid.uuid4()

    moved = await store.moves(
        [
            MoveRequest.of(held, "node-a/1", since, "node-a.2/1"),
            MoveRequest.of(taken, "node-a/2", await since_of(redis, store, taken), "node-a.2/2"),
            MoveRequest.of(gone, "node-a/3", 5, "node-a.2/3"),
        ]
    )

    assert moved[0] >= since and moved[1:] == [0, 0]
    fields = await redis.hgetall(store.keys.session_keys(held)[0])
    assert fields["conn"] == "node-a.2/1" and int(fields["since"]) == moved[0]
    assert {k: v for k, v in fields.items() if k not in ("conn", "since")} == {
        k: v for k, v in fields_before.items() if k not in ("conn", "since")
    }  # its clocks, proof and token stay
    # The new connection's heartbeats are its own; the old one's are taken over.
    request = store.heartbeat_request(held, "node-a.2/1")
    [answer] = await store.record_heartbeats([request])
    assert isinstance(answer, int)
    [old] = await store.record_heartbeats([store.heartbeat_request(held, "node-a/1")])
    assert getattr(old, "outcome", None) is HeartbeatOutcome.TAKEN
    stream = replies.entries(await redis.xrange(store.keys.script_keys(held)[1]))
    kinds = [json.loads(entry["event"]) for _, entry in stream]
    assert [e["type"] for e in kinds if e["tid"] == str(held)] == ["SESSION_STARTED"]


async def test_a_stale_since_does_not_move(store: Store, redis: Redis) -> None:
    tid = await started(store, "node-a/1")
    since = await since_of(redis, store, tid)
    assert await store.moves([MoveRequest.of(tid, "node-a/1", since - 1, "node-a.2/1")]) == [0]


async def test_a_move_back_takes_the_session_from_any_connection_of_the_dead_node(
    store: Store, redis: Redis
) -> None:
    tid = await started(store, "node-a/1")
    since = await since_of(redis, store, tid)
    [moved] = await store.moves([MoveRequest.of(tid, "node-a/1", since, "node-a.2/17")])
    assert moved

    assert await store.moves([MoveRequest.of(tid, "node-a.3", None, "node-a/1")]) == [0]
    [back] = await store.moves([MoveRequest.of(tid, "node-a.2", None, "node-a/1")])
    assert back >= moved
    assert await redis.hget(store.keys.session_keys(tid)[0], "conn") == "node-a/1"
