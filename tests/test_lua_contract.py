"""The contract between the Lua scripts and Python, held by name.

* Every script reads the session hash through the prelude's ``load_session`` (one HMGET
  of the field list Python declares), never a field by its position in a reply.
* Close codes, states and outcomes come from Python's enums, never Lua literals.
* heartbeat.lua and hello.lua expire a session exactly when :mod:`tokend.core.lifecycle` says it
  is expired, for the same reason; sweep.lua makes the transitions it says are due;
  release.lua parks a session exactly when it says so (``parked_heartbeat``), and
  hello.lua refuses a resume without the proof exactly when it says the session is held
  live by another connection (``held_live``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from importlib import resources

import pytest
from redis.asyncio import Redis

from testkit import replies
from testkit.stores import (
    CLOCKS,
    EXPIRE_MS,
    HEARTBEAT_MS,
    WARN_MS,
    redis_ms,
    store,
    sweep,
)
from tokend.core.lifecycle import (
    ExpiryReason,
    State,
    deadline,
    due_transition,
    held_live,
    parked_heartbeat,
)
from tokend.core.store_messages import (
    Ended,
    HeartbeatAnswer,
    HeartbeatOutcome,
    HelloOutcome,
    ReleaseOutcome,
    heartbeat_outcome,
)
from tokend.store.keyspace import HEARTBEAT_FIELDS, SESSION_FIELDS, Keyspace
from tokend.store.scripts import SCRIPTS, lua_constants
from tokend.store.sessions import HelloRequest, Store, proof_digest

__all__ = ["store"]  # a fixture of testkit

LUA = resources.files("tokend.store") / "lua"
PRELUDE = "_prelude.lua"
# Commands whose reply holds a hash's fields by position.
HASH_READS = re.compile(r"'(HMGET|HGETALL|HVALS)'", re.IGNORECASE)
SESSION_TABLE = re.compile(r"(\w+)\s*=\s*load_session\(")


def _code(source: str) -> str:
    """``source`` without its comments (no script has ``--`` inside a string)."""
    return "\n".join(line.partition("--")[0] for line in source.splitlines())


def positional_reads(name: str, source: str) -> list[str]:
    """Where a script reads a session hash field by position: what the contract forbids."""
    code = _code(source)
    found = []
    for match in HASH_READS.finditer(code):
        function = code[: match.start()].rpartition("local function ")[2].partition("(")[0]
        if (name, function) != (PRELUDE, "load_session"):
            found.append(f"{name}: {match.group(1)} outside load_session")
    for table in set(SESSION_TABLE.findall(code)):
        for index in re.findall(rf"\b{table}\[(\d+)\]", code):
            found.append(f"{name}: {table}[{index}]")
    return found


def _sources() -> dict[str, str]:
    return {f.name: f.read_text() for f in LUA.iterdir() if f.name.endswith(".lua")}


def test_no_script_reads_a_session_field_by_position() -> None:
    sources = _sources()
    assert {s.name + ".lua" for s in SCRIPTS} | {PRELUDE} == set(sources)
    assert [p for name, text in sources.items() for p in positional_reads(name, text)] == []
    # The one read names the fields Python declares.
    assert "redis.call('HMGET', skey, unpack(SESSION_FIELDS, 1, fields))" in sources[PRELUDE]


@pytest.mark.parametrize(
    "source",
    [
        "local s = redis.call('HMGET', skey, 'sub', 'exp')\nreturn s[2]",
        "local function read(k)\n  return redis.call('hgetall', k)\nend",
        "local s = load_session(skey)\nreturn s[1]",
    ],
)
def test_a_positional_read_is_caught(source: str) -> None:
    assert positional_reads("heartbeat.lua", source)


def test_a_heartbeat_uses_only_the_fields_it_reads() -> None:
    """heartbeat.lua reads the first HEARTBEAT_FIELDS of the session (load_session's
    second argument): every field of a session it uses must be among them."""
    code = _code(_sources()["heartbeat.lua"])
    assert code.count("load_session(skey, HEARTBEAT_FIELDS)") == len(SESSION_TABLE.findall(code))
    used = set(re.findall(r"\bs\.(\w+)", code))
    assert used and used <= set(SESSION_FIELDS[:HEARTBEAT_FIELDS]), used
    assert {"left", "proof"}.isdisjoint(SESSION_FIELDS[:HEARTBEAT_FIELDS])


def test_no_close_code_is_written_as_a_number() -> None:
    """Close codes come from tokend.core.protocol.CloseCode (the generated CLOSE table)."""
    for name, text in _sources().items():
        assert not re.findall(r"\b4\d{3}\b", _code(text)), name
    for path in (p for p in resources.files("tokend.store").iterdir() if p.name.endswith(".py")):
        code = "\n".join(line.partition("#")[0] for line in path.read_text().splitlines())
        assert not re.findall(r"\b4\d{3}\b", code), path.name


def test_the_generated_constants_name_every_python_value() -> None:
    constants = lua_constants()
    assert "SESSION_EXPIRED = 4505" in constants and "TAKEN_OVER = 4507" in constants
    assert "local SESSION_FIELDS = {" + ", ".join(f"'{f}'" for f in SESSION_FIELDS) in constants
    for script in SCRIPTS:
        assert script.source.startswith(constants)


async def test_load_session_reads_every_field_by_name(store: Store, redis: Redis) -> None:
    tid = uuid.uuid4()
    skey = store.keys.session_keys(tid)[0]
    fields: dict[str, str | int] = {
        "sub": "alice",
        "st": "WARN",
        "hb": 11,
        "exp": 22,
        "iat": 33,
        "prio": 4,
        "conn": "node-a/5",
        "since": 66,
        "left": "node-b/6",
        "proof": "0f" * 16,
        "pk": 77,
    }
    assert set(fields) == set(SESSION_FIELDS)
    await redis.hset(skey, mapping=replies.mapping(fields))
    prelude = lua_constants() + (LUA / PRELUDE).read_text()
    args: list[str | int] = ["node-a", "e", "c", 10, int(time.time() * 1000) + 60_000]
    read = "return cjson.encode(load_session(KEYS[3]))"
    keys = [*store.keys.shard_keys(Keyspace.shard(tid)), skey]
    assert json.loads(await redis.eval(prelude + read, 3, *keys, *args)) == fields
    # A heartbeat's read: the first HEARTBEAT_FIELDS only.
    first = "return cjson.encode(load_session(KEYS[3], HEARTBEAT_FIELDS))"
    hot = SESSION_FIELDS[:HEARTBEAT_FIELDS]
    assert json.loads(await redis.eval(prelude + first, 3, *keys, *args)) == {
        name: value for name, value in fields.items() if name in hot
    }
    missing = "return load_session(KEYS[3]) == nil and 1 or 0"
    await redis.delete(skey)
    assert await redis.eval(prelude + missing, 3, *keys, *args) == 1


# --- heartbeat.lua, hello.lua and sweep.lua decide as tokend.core.lifecycle does ------------------

# Times a second or more away from every boundary, so that the few milliseconds between
# reading Redis time here and the script's own cannot change a verdict.
SILENCES = (1_000, WARN_MS - 1_000, WARN_MS + 1_000, EXPIRE_MS - 1_000, EXPIRE_MS + 1_000)
TOKEN_LEFT = (-1_000, 3_000, WARN_MS + 3_000, 3_600_000)
Case = tuple[State, int, int]  # state, last heartbeat, exp
# The resume proof of the grid's sessions: each is held by a connection of its own, some
# live (tokend.core.lifecycle.held_live), and a resume shows it unless a test is about that.
PROOF = bytes(range(16))


async def _sessions(store: Store, redis: Redis, now: int) -> dict[uuid.UUID, Case]:
    """Live sessions over the grid of (state, silence, token time left), as of ``now``."""
    cases = {
        uuid.uuid4(): (state, now - silence, now + left)
        for state in (State.ACTIVE, State.WARN)
        for silence in SILENCES
        for left in TOKEN_LEFT
    }
    for tid, case in cases.items():
        await _put_session(store, redis, tid, case)
    return cases


async def _put_session(store: Store, redis: Redis, tid: uuid.UUID, case: Case) -> None:
    """A live session (state, last heartbeat, exp), held by connection node-z/<tid>."""
    state, hb, exp = case
    await redis.hset(
        store.keys.session_keys(tid)[0],
        mapping={
            "sub": "s",
            "st": state.value,
            "hb": hb,
            "exp": exp,
            "iat": exp // 1000 - 60,
            "prio": 5,
            "conn": f"node-z/{tid}",
            "since": 1,
            "proof": proof_digest(PROOF),
        },
    )


async def _events(store: Store, redis: Redis, kind: str) -> dict[str, dict[str, object]]:
    """The last event of type ``kind`` of each tid in the shards' streams."""
    found = {}
    for stream in store.keys.streams():
        for _, fields in replies.entries(await redis.xrange(stream)):
            event = json.loads(fields["event"])
            if event["type"] == kind:
                found[event["tid"]] = event
    return found


async def _expiry_reasons(store: Store, redis: Redis) -> dict[str, str]:
    """The reason of each TOKEN_EXPIRED event in the shards' streams, by tid."""
    return {
        tid: str(e["reason"]) for tid, e in (await _events(store, redis, "TOKEN_EXPIRED")).items()
    }


def _expected(
    case: Case, now: int, judged: Callable[[ExpiryReason], bool] = lambda _: True
) -> ExpiryReason | None:
    """The expiry tokend.core.lifecycle decides for ``case`` at ``now`` (None: it lives on)."""
    state, hb, exp = case
    due = due_transition(state, hb, exp, now, CLOCKS)
    if due is None or due.to is not State.EXPIRED:
        return None
    assert due.reason is not None
    return due.reason if judged(due.reason) else None


@pytest.mark.parametrize("replayed", [False, True], ids=["live", "replayed"])
async def test_a_heartbeat_expires_as_clocks_does(
    store: Store, redis: Redis, replayed: bool
) -> None:
    """A replayed heartbeat (received in time, stored after an outage) is not judged for
    silence: only its token's exp can expire it."""
    now = await redis_ms(store)
    cases = await _sessions(store, redis, now)
    tids = list(cases)
    answers = await store.record_heartbeats(
        [store.heartbeat_request(tid, f"node-z/{tid}") for tid in tids], [replayed] * len(tids)
    )
    reasons = await _expiry_reasons(store, redis)
    for tid, answer in zip(tids, answers, strict=True):
        expected = _expected(
            cases[tid],
            now,
            lambda reason: not replayed or reason is ExpiryReason.TOKEN_EXPIRED,
        )
        case = (*cases[tid], replayed)
        if expected is None:
            assert heartbeat_outcome(answer) is HeartbeatOutcome.OK, case
            # A plain OK (an integer) did not leave WARN.
            was_warn = not isinstance(answer, int) and answer.was_warn
            assert was_warn == (cases[tid][0] is State.WARN), case
            assert str(tid) not in reasons, case
        else:
            assert isinstance(answer, HeartbeatAnswer), case
            assert (answer.outcome, answer.ended) == (HeartbeatOutcome.GONE, Ended.EXPIRED), case
            assert reasons[str(tid)] == expected, case
    assert set(reasons.values()) == (
        {ExpiryReason.TOKEN_EXPIRED} if replayed else set(ExpiryReason)
    )


async def test_a_resume_expires_as_clocks_does(store: Store, redis: Redis) -> None:
    now = await redis_ms(store)
    cases = await _sessions(store, redis, now)
    tids = list(cases)
    # exp 0: the token is no newer than the session, so the session's exp is judged.
    answers = await store.hellos(
        [HelloRequest(tid, "s", 5, 0, 0, "node-a/1", PROOF) for tid in tids]
    )
    reasons = await _expiry_reasons(store, redis)
    for tid, answer in zip(tids, answers, strict=True):
        expected = _expected(cases[tid], now)
        case = cases[tid]
        if expected is None:
            assert answer.outcome is HelloOutcome.RESUMED, case
            assert str(tid) not in reasons, case
        elif expected is ExpiryReason.TOKEN_EXPIRED:
            assert answer.outcome is HelloOutcome.EXPIRED, case
            assert reasons[str(tid)] == expected, case
        else:
            assert (answer.outcome, answer.ended) == (HelloOutcome.ENDED, Ended.EXPIRED), case
            assert reasons[str(tid)] == expected, case
    assert set(reasons.values()) == set(ExpiryReason)


async def test_a_sweep_judges_as_clocks_does(store: Store, redis: Redis) -> None:
    """sweep.lua against tokend.core.lifecycle: the transition made, the deadline put back."""
    now = await redis_ms(store)
    cases = await _sessions(store, redis, now)
    made = await sweep(store, list(cases))
    for tid, (state, hb, exp) in cases.items():
        expected = due_transition(state, hb, exp, now, CLOCKS)
        fields = await redis.hgetall(store.keys.session_keys(tid)[0])
        score = await redis.zscore(store.keys.script_keys(tid)[0], str(tid))
        case = (state, now - hb, exp - now)
        if expected is None:
            assert str(tid) not in made and fields["st"] == state.value, case
            assert score == deadline(state, hb, exp, CLOCKS), case
        elif expected.to is State.WARN:
            assert made[str(tid)] == ("warn", "") and fields["st"] == "WARN", case
            assert score == deadline(State.WARN, hb, exp, CLOCKS), case
        else:
            assert made[str(tid)] == (expected.reason, ""), case
            assert not fields and score is None, case
    assert {what for what, _ in made.values()} == {"warn", "token_expired", "heartbeat_timeout"}


# --- release.lua parks as tokend.core.lifecycle does; hello.lua holds a live session as it does ---


async def test_a_planned_close_parks_as_clocks_does(store: Store, redis: Redis) -> None:
    """The server closed each connection with 1001: an ACTIVE session with nothing due
    is parked, the close its heartbeat, the others keep theirs; every one is released
    (``conn`` moves to ``left``)."""
    now = await redis_ms(store)
    cases = await _sessions(store, redis, now)
    tids = list(cases)
    outcomes = await store.releases(
        [store.release_request(tid, f"node-z/{tid}", 1, "going_away") for tid in tids]
    )
    parked = await _events(store, redis, "SESSION_PARKED")
    for tid, outcome in zip(tids, outcomes, strict=True):
        state, hb, exp = cases[tid]
        fields = await redis.hgetall(store.keys.session_keys(tid)[0])
        score = await redis.zscore(store.keys.script_keys(tid)[0], str(tid))
        expected = parked_heartbeat(state, hb, exp, now, CLOCKS)
        case = (state, now - hb, exp - now)
        assert "conn" not in fields and fields["left"] == f"node-z/{tid}", case
        assert fields["st"] == state.value, case
        if expected is None:
            assert outcome is ReleaseOutcome.RELEASED, case
            assert int(fields["hb"]) == hb and score is None and str(tid) not in parked, case
        else:
            assert outcome is ReleaseOutcome.PARKED, case
            # The script's now is the few milliseconds after the test's.
            assert 0 <= int(fields["hb"]) - expected < 1_000, case
            assert score == deadline(State.ACTIVE, int(fields["hb"]), exp, CLOCKS), case
            event = parked[str(tid)]
            assert (event["reason"], event["node"], event["sub"]) == ("going_away", "node-z", "s")
    assert set(outcomes) == {ReleaseOutcome.PARKED, ReleaseOutcome.RELEASED}


async def test_an_unplanned_end_releases_and_changes_no_clock(store: Store, redis: Redis) -> None:
    now = await redis_ms(store)
    cases = await _sessions(store, redis, now)
    tids = list(cases)
    outcomes = await store.releases(
        [store.release_request(tid, f"node-z/{tid}", 1, "") for tid in tids]
    )
    assert outcomes == [ReleaseOutcome.RELEASED] * len(tids)
    for tid, (state, hb, _) in cases.items():
        fields = await redis.hgetall(store.keys.session_keys(tid)[0])
        assert "conn" not in fields and fields["left"] == f"node-z/{tid}"
        assert (fields["st"], int(fields["hb"])) == (state.value, hb)
        assert await redis.zscore(store.keys.script_keys(tid)[0], str(tid)) is None
    assert await _events(store, redis, "SESSION_PARKED") == {}


async def test_a_resumed_parked_session_stays_parked_until_its_first_heartbeat(
    store: Store, redis: Redis
) -> None:
    """A resume whose client never heartbeats on it (it gave up before the WELCOME and
    tries again) leaves the session parked, held as the restart goes on; the first
    heartbeat after a resume unparks it, and a later end is an ordinary one."""
    now = await redis_ms(store)
    abandoned, back = uuid.uuid4(), uuid.uuid4()
    tids = [abandoned, back]
    for tid in tids:
        await _put_session(store, redis, tid, (State.ACTIVE, now - 1_000, now + 3_600_000))
    parked = await store.releases(
        [store.release_request(tid, f"node-z/{tid}", 1, "going_away") for tid in tids]
    )
    assert parked == [ReleaseOutcome.PARKED] * 2
    answers = await store.hellos(
        [HelloRequest(tid, "s", 5, 0, 0, "node-a/1", PROOF) for tid in tids]
    )
    assert [a.outcome for a in answers] == [HelloOutcome.RESUMED] * 2
    for tid in tids:
        fields = await redis.hgetall(store.keys.session_keys(tid)[0])
        assert fields["conn"] == "node-a/1" and "pk" in fields, fields
    [stored] = await store.record_heartbeats([store.heartbeat_request(back, "node-a/1")])
    assert heartbeat_outcome(stored) is HeartbeatOutcome.OK
    ended = await store.releases(
        [
            store.release_request(tid, "node-a/1", a.since_ms, "")
            for tid, a in zip(tids, answers, strict=True)
        ]
    )
    assert ended == [ReleaseOutcome.RELEASED] * 2
    still = await redis.hgetall(store.keys.session_keys(abandoned)[0])
    assert "conn" not in still and "pk" in still, still
    gone = await redis.hgetall(store.keys.session_keys(back)[0])
    assert "conn" not in gone and "pk" not in gone, gone


async def test_a_connection_that_lost_its_session_releases_nothing(
    store: Store, redis: Redis
) -> None:
    """Taken over (another conn), or a connection of a node that restarted under the same
    name and numbered alike (same conn, other since), or ended (no session)."""
    now = await redis_ms(store)
    cases = await _sessions(store, redis, now)
    tid, other, ended = list(cases)[:3]
    await redis.delete(store.keys.session_keys(ended)[0])
    before = await redis.hgetall(store.keys.session_keys(tid)[0])
    outcomes = await store.releases(
        [
            store.release_request(tid, "node-a/1", 1, "going_away"),
            store.release_request(other, f"node-z/{other}", 2, "going_away"),
            store.release_request(ended, f"node-z/{ended}", 1, ""),
        ]
    )
    assert outcomes == [ReleaseOutcome.NOT_HELD] * 3
    assert await redis.hgetall(store.keys.session_keys(tid)[0]) == before
    assert "conn" in await redis.hgetall(store.keys.session_keys(other)[0])
    assert not await redis.exists(store.keys.session_keys(ended)[0])


LIVE_MS = HEARTBEAT_MS + 15_000  # spec "Resume proof": heartbeat_interval + 15 s


@pytest.mark.parametrize(
    "shown", [None, b"not the proof...", PROOF], ids=["none", "wrong", "right"]
)
async def test_a_resume_is_refused_exactly_while_clocks_say_held_live(
    store: Store, redis: Redis, shown: bytes | None
) -> None:
    """A HELLO without the proof of the holding connection's key cannot take a session held
    live (4509, nothing written); with it, or once the session is not held live (no
    connection holds it, or it has been silent past the window), it resumes."""
    now = await redis_ms(store)
    cases = {
        uuid.uuid4(): (held, now - silence)
        for held in (True, False)
        for silence in (1_000, LIVE_MS - 1_000, LIVE_MS + 1_000)
    }
    for tid, (held, hb) in cases.items():
        holder = {"conn": f"node-z/{tid}"} if held else {"left": f"node-z/{tid}"}
        await redis.hset(
            store.keys.session_keys(tid)[0],
            mapping=replies.mapping(
                {
                    "sub": "s",
                    "st": "ACTIVE",
                    "hb": hb,
                    "exp": now + 3_600_000,
                    "iat": now // 1000,
                    "prio": 5,
                    "since": 1,
                    "proof": proof_digest(PROOF),
                    **holder,
                }
            ),
        )
    before = {tid: await redis.hgetall(store.keys.session_keys(tid)[0]) for tid in cases}
    tids = list(cases)
    answers = await store.hellos(
        [HelloRequest(tid, "s", 5, 0, 0, "node-a/1", shown, b"next") for tid in tids]
    )
    resumed = await _events(store, redis, "SESSION_RESUMED")
    for tid, answer in zip(tids, answers, strict=True):
        held, hb = cases[tid]
        case = (held, now - hb, shown)
        fields = await redis.hgetall(store.keys.session_keys(tid)[0])
        if held_live(held, hb, now, HEARTBEAT_MS) and shown != PROOF:
            assert answer.outcome is HelloOutcome.IN_USE, case
            assert fields == before[tid] and str(tid) not in resumed, case
        else:
            assert answer.outcome is HelloOutcome.RESUMED, case
            assert (fields["conn"], fields["proof"]) == ("node-a/1", proof_digest(b"next")), case
            assert "left" not in fields and str(tid) in resumed, case
    outcomes = {a.outcome for a in answers}
    assert outcomes == (
        {HelloOutcome.RESUMED} if shown == PROOF else {HelloOutcome.RESUMED, HelloOutcome.IN_USE}
    )
