"""Unit tests of the session lifecycle (tokend/core/lifecycle.py) on a fake clock of integers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tokend.core.lifecycle import (
    HELD_LIVE_SLACK_MS,
    Clocks,
    ExpiryReason,
    State,
    Transition,
    deadline,
    due_transition,
    held_live,
    off_redis_leave_after_ms,
    parked_heartbeat,
    parked_hold,
    resume_outlasted,
    serving_rank,
    unparked_heartbeat,
)

WARN = 90_000
EXPIRE = 120_000
CLOCKS = Clocks(WARN, EXPIRE)
HB = 1_764_680_000_000  # last heartbeat, ms
EXP = HB + 900_000  # token expiry, well after both clocks

TO_WARN = Transition(State.WARN)
HB_TIMEOUT = Transition(State.EXPIRED, ExpiryReason.HEARTBEAT_TIMEOUT)
TOKEN_EXPIRED = Transition(State.EXPIRED, ExpiryReason.TOKEN_EXPIRED)

# (state, last heartbeat, exp, now, expected transition)
CASES: dict[str, tuple[State, int, int, int, Transition | None]] = {
    "active right after heartbeat": (State.ACTIVE, HB, EXP, HB, None),
    "active clock behind heartbeat": (State.ACTIVE, HB, EXP, HB - 5_000, None),
    "active 1 ms before warn": (State.ACTIVE, HB, EXP, HB + WARN - 1, None),
    "active exactly at warn": (State.ACTIVE, HB, EXP, HB + WARN, TO_WARN),
    "active between warn and expire": (State.ACTIVE, HB, EXP, HB + WARN + 10_000, TO_WARN),
    "active 1 ms before expire": (State.ACTIVE, HB, EXP, HB + EXPIRE - 1, TO_WARN),
    "active jumps to expire (no WARN)": (State.ACTIVE, HB, EXP, HB + EXPIRE, HB_TIMEOUT),
    "active far past expire": (State.ACTIVE, HB, EXP, HB + EXPIRE + 60_000, HB_TIMEOUT),
    "warn at warn time": (State.WARN, HB, EXP, HB + WARN, None),
    "warn 1 ms before expire": (State.WARN, HB, EXP, HB + EXPIRE - 1, None),
    "warn exactly at expire": (State.WARN, HB, EXP, HB + EXPIRE, HB_TIMEOUT),
    "warn past expire": (State.WARN, HB, EXP, HB + EXPIRE + 1, HB_TIMEOUT),
    "active 1 ms before exp": (State.ACTIVE, HB, HB + 1_000, HB + 999, None),
    "active at exp": (State.ACTIVE, HB, HB + 1_000, HB + 1_000, TOKEN_EXPIRED),
    "active past exp": (State.ACTIVE, HB, HB + 1_000, HB + 50_000, TOKEN_EXPIRED),
    "warn at exp": (State.WARN, HB, HB + WARN + 5_000, HB + WARN + 5_000, TOKEN_EXPIRED),
    "exp already past at heartbeat": (State.ACTIVE, HB, HB - 1, HB, TOKEN_EXPIRED),
    "both due, active: token wins": (State.ACTIVE, HB, HB + 100_000, HB + EXPIRE, TOKEN_EXPIRED),
    "both due, warn: token wins": (State.WARN, HB, HB + 100_000, HB + EXPIRE + 1, TOKEN_EXPIRED),
    "exp == expire time: token wins": (State.WARN, HB, HB + EXPIRE, HB + EXPIRE, TOKEN_EXPIRED),
    "exp before warn, warn due too": (State.ACTIVE, HB, HB + 10_000, HB + WARN, TOKEN_EXPIRED),
    "expired stays put": (State.EXPIRED, HB, EXP, HB + 10 * EXPIRE, None),
    "expired after exp": (State.EXPIRED, HB, HB + 1, HB + 10 * EXPIRE, None),
    "expired at heartbeat": (State.EXPIRED, HB, EXP, HB, None),
}


@pytest.mark.parametrize(("state", "hb", "exp", "now", "expected"), CASES.values(), ids=CASES)
def test_due_transition(
    state: State, hb: int, exp: int, now: int, expected: Transition | None
) -> None:
    assert due_transition(state, hb, exp, now, CLOCKS) == expected


def test_warn_transition_has_no_reason() -> None:
    transition = due_transition(State.ACTIVE, HB, EXP, HB + WARN, CLOCKS)
    assert transition is not None
    assert transition.to is State.WARN
    assert transition.reason is None


def test_expiry_reasons_are_the_event_strings() -> None:
    assert [str(reason) for reason in ExpiryReason] == ["heartbeat_timeout", "token_expired"]


# --- deadline ---------------------------------------------------------------------------------

DEADLINES: dict[str, tuple[State, int, int]] = {
    "active, warn first": (State.ACTIVE, EXP, HB + WARN),
    "active, exp first": (State.ACTIVE, HB + 1_000, HB + 1_000),
    "active, exp == warn time": (State.ACTIVE, HB + WARN, HB + WARN),
    "warn, expire first": (State.WARN, EXP, HB + EXPIRE),
    "warn, exp first": (State.WARN, HB + 100_000, HB + 100_000),
    "warn, exp == expire time": (State.WARN, HB + EXPIRE, HB + EXPIRE),
}


@pytest.mark.parametrize(("state", "exp", "expected"), DEADLINES.values(), ids=DEADLINES)
def test_deadline(state: State, exp: int, expected: int) -> None:
    assert deadline(state, HB, exp, CLOCKS) == expected


def test_expired_session_has_no_deadline() -> None:
    with pytest.raises(ValueError):
        deadline(State.EXPIRED, HB, EXP, CLOCKS)


def test_a_heartbeat_restarts_the_clocks() -> None:
    # WARN at hb + warn; a heartbeat then makes it ACTIVE with a fresh warn deadline.
    assert due_transition(State.ACTIVE, HB, EXP, HB + WARN, CLOCKS) == TO_WARN
    later = HB + WARN + 1_000
    assert due_transition(State.ACTIVE, later, EXP, later, CLOCKS) is None
    assert deadline(State.ACTIVE, later, EXP, CLOCKS) == later + WARN


# --- property: deadline() is exactly when due_transition() first fires ----------------------

live_states = st.sampled_from([State.ACTIVE, State.WARN])
times = st.integers(0, 2**42)


@st.composite
def clocks(draw: st.DrawFn) -> Clocks:
    warn = draw(st.integers(1, 10**7))
    return Clocks(warn, warn + draw(st.integers(1, 10**7)))


@settings(max_examples=200, deadline=None)
@given(live_states, times, times, clocks(), st.integers(1, 2**43))
def test_nothing_due_before_the_deadline_and_due_at_it(
    state: State, hb: int, exp: int, clk: Clocks, before: int
) -> None:
    due = deadline(state, hb, exp, clk)
    assert due_transition(state, hb, exp, due - 1, clk) is None
    assert due_transition(state, hb, exp, due - before, clk) is None
    at = due_transition(state, hb, exp, due, clk)
    assert at is not None
    if due == exp:
        assert at == TOKEN_EXPIRED
    elif state is State.ACTIVE:
        assert at == TO_WARN
    else:
        assert at == HB_TIMEOUT


@settings(max_examples=200, deadline=None)
@given(live_states, times, times, clocks(), st.integers(0, 2**43))
def test_once_due_always_due(state: State, hb: int, exp: int, clk: Clocks, after: int) -> None:
    # A late sweep still finds the transition (possibly a later one).
    due = deadline(state, hb, exp, clk)
    assert due_transition(state, hb, exp, due + after, clk) is not None


@settings(max_examples=200, deadline=None)
@given(times, times, clocks(), st.integers(-(2**43), 2**43))
def test_active_never_skips_to_warn_past_expiry(hb: int, exp: int, clk: Clocks, dt: int) -> None:
    now = hb + dt
    result = due_transition(State.ACTIVE, hb, exp, now, clk)
    if now >= exp:
        assert result == TOKEN_EXPIRED
    elif dt >= clk.expire_after_ms:
        assert result == HB_TIMEOUT
    elif dt >= clk.warn_after_ms:
        assert result == TO_WARN
    else:
        assert result is None


# --- a planned close (the server's 1001): parked_heartbeat --------------------------------------


def test_a_planned_close_counts_as_a_heartbeat_of_an_active_session() -> None:
    """Silent 100 s of its 120 s when the drain closes it: the close is its heartbeat."""
    closed_at = HB + WARN - 1
    parked = parked_heartbeat(State.ACTIVE, HB, EXP, closed_at, CLOCKS)
    assert parked == closed_at
    # Where the old clocks expired it, the parked ones have not even warned.
    assert due_transition(State.ACTIVE, HB, EXP, HB + EXPIRE, CLOCKS) == HB_TIMEOUT
    assert due_transition(State.ACTIVE, parked, EXP, HB + EXPIRE, CLOCKS) is None


def test_a_parked_session_is_held_while_its_shard_resumes_and_then_runs_from_the_hold() -> None:
    """The hold follows the restart: warn_after past the last resume of a parked session of
    the shard, or past the sweeping node's start; then the clocks run from its end."""
    closed_at = HB
    assert parked_hold(0, closed_at + 5_000, WARN) == closed_at + 5_000 + WARN
    assert parked_hold(closed_at + 90_000, closed_at + 5_000, WARN) == closed_at + 90_000 + WARN
    hold = parked_hold(closed_at + 90_000, 0, WARN)
    assert unparked_heartbeat(closed_at, hold) == hold
    assert (
        due_transition(State.ACTIVE, unparked_heartbeat(closed_at, hold), EXP, hold, CLOCKS) is None
    )
    # A hold long past: the clocks run from the close, as for any silent client.
    assert unparked_heartbeat(closed_at, closed_at - 1) == closed_at


@pytest.mark.parametrize(
    ("state", "exp", "now"),
    [
        (State.WARN, EXP, HB + WARN + 1),  # silent past warn_after before the close
        (State.ACTIVE, EXP, HB + WARN),  # due for WARN, not yet swept
        (State.ACTIVE, EXP, HB + EXPIRE),  # due to expire
        (State.ACTIVE, HB + 1_000, HB + 1_000),  # its token's exp has come
    ],
    ids=["warn", "due-warn", "due-expire", "token-expired"],
)
def test_a_session_silent_before_the_close_keeps_its_clocks(
    state: State, exp: int, now: int
) -> None:
    assert parked_heartbeat(state, HB, exp, now, CLOCKS) is None


@settings(max_examples=200, deadline=None)
@given(times, times, clocks(), st.integers(0, 2**40))
def test_parking_only_ever_moves_the_deadline_later_and_never_past_exp(
    hb: int, exp: int, clk: Clocks, dt: int
) -> None:
    now = hb + dt
    parked = parked_heartbeat(State.ACTIVE, hb, exp, now, clk)
    if due_transition(State.ACTIVE, hb, exp, now, clk) is not None:
        assert parked is None
        return
    assert parked is not None
    assert deadline(State.ACTIVE, hb, exp, clk) <= deadline(State.ACTIVE, parked, exp, clk) <= exp
    assert due_transition(State.ACTIVE, parked, exp, now, clk) is None


# --- held live (spec "Resume proof", revision 2) -------------------------------------------------


def test_a_session_is_held_live_up_to_an_interval_and_15_s_after_the_last_heartbeat() -> None:
    interval = 30_000
    assert HELD_LIVE_SLACK_MS == 15_000
    assert held_live(True, HB, HB, interval)
    assert held_live(True, HB, HB + interval + HELD_LIVE_SLACK_MS, interval)
    assert not held_live(True, HB, HB + interval + HELD_LIVE_SLACK_MS + 1, interval)
    # No connection holds it (the one that did ended): never held live.
    assert not held_live(False, HB, HB, interval)


def test_a_session_outlasts_a_lost_connections_hold_with_the_defaults_only_if_set_so() -> None:
    assert not resume_outlasted(30_000, 120_000)  # the defaults: 45 s held, 120 s to expire
    assert not resume_outlasted(30_000, 45_001)
    assert resume_outlasted(30_000, 45_000)
    assert resume_outlasted(200, 1_200)  # the tests' short clocks


@settings(max_examples=200, deadline=None)
@given(clocks(), st.integers(1, 10**7))
def test_a_node_off_redis_lets_a_connection_go_while_the_cluster_has_its_session_in_warn(
    clk: Clocks, interval: int
) -> None:
    """Counted from the first heartbeat left unstored, one interval after the last one
    stored: the rest of the cluster has the session in WARN by then, not yet EXPIRED."""
    assume(interval < clk.warn_after_ms)  # tokend.config: heartbeat_interval < warn_after
    leave_after = off_redis_leave_after_ms(interval, clk)
    assert leave_after > 0
    assert clk.warn_after_ms <= interval + leave_after < clk.expire_after_ms


def test_a_node_off_redis_lets_go_halfway_from_warn_to_expired() -> None:
    assert off_redis_leave_after_ms(30_000, Clocks(90_000, 120_000)) == 75_000  # the defaults
    assert off_redis_leave_after_ms(2_000, Clocks(6_000, 25_000)) == 13_500  # the fault runs'


# --- Clocks validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("warn", "expire"),
    [(120, 120), (121, 120), (0, 120), (-1, 120), (90, 0), (90, -5), (0, 0), (-10, -5)],
)
def test_clocks_refuse_bad_values(warn: int, expire: int) -> None:
    with pytest.raises(ValueError):
        Clocks(warn, expire)


def test_clocks_accept_warn_just_below_expire() -> None:
    assert Clocks(1, 2) == Clocks(warn_after_ms=1, expire_after_ms=2)


# --- the Lua scripts keep the same deadlines -------------------------------------------------

LUA = Path(__file__).resolve().parent.parent / "tokend" / "store" / "lua"
ZADD_DEADLINE = re.compile(r"redis\.call\('ZADD', DUE, (math\.min\(.*\)), tid\)")


def _lua_deadlines() -> list[tuple[str, str]]:
    found = []
    for path in sorted(LUA.glob("*.lua")):
        for line in path.read_text().splitlines():
            if match := ZADD_DEADLINE.search(line):
                found.append((path.name, match.group(1)))
    return found


def _eval_lua_expression(expr: str, names: dict[str, object]) -> int:
    """Evaluate a simple Lua arithmetic expression (math.min, +, names, ARGV[n]) in Python."""
    python = expr.replace("math.min", "min")
    assert re.fullmatch(r"[\w\s+(),\[\]]+", python), expr
    return int(eval(python, {"__builtins__": {}}, {"min": min, "tonumber": int, **names}))


def test_lua_scripts_schedule_the_same_deadlines_as_clocks() -> None:
    """hello/heartbeat schedule deadline(ACTIVE, now, exp); the sweep to WARN deadline(WARN)."""
    found = _lua_deadlines()
    assert {name for name, _ in found} >= {"hello.lua", "heartbeat.lua", "sweep.lua"}
    now, exp = HB + 7, HB + 200_000
    for name, expr in found:
        names: dict[str, object] = {
            "now": now,
            "hb": now,
            "exp": exp,
            "warn_ms": WARN,
            "expire_ms": EXPIRE,
        }
        got = _eval_lua_expression(expr, names)
        state = State.WARN if name == "sweep.lua" else State.ACTIVE
        assert got == deadline(state, now, exp, CLOCKS), (name, expr)
        # The token's exp caps the deadline there too.
        names["exp"] = now + 1
        assert _eval_lua_expression(expr, names) == deadline(state, now, now + 1, CLOCKS)


def test_serving_rank_orders_prio_then_warn_last():
    active = sorted(range(10), key=lambda prio: serving_rank(prio, warned=False))
    assert active == list(range(9, -1, -1))  # higher prio served first
    # Every WARN session after every ACTIVE one, whatever the prios.
    assert max(serving_rank(prio, warned=False) for prio in range(10)) < min(
        serving_rank(prio, warned=True) for prio in range(10)
    )
