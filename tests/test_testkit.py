"""The shared wait (testkit.waiting): it must fail, or every test built on it passes
whatever happens."""

from __future__ import annotations

import itertools

import pytest

from testkit.waiting import eventually, eventually_sync


async def test_eventually_returns_the_first_truthy_result_of_a_function_or_coroutine() -> None:
    calls = itertools.count(1)
    assert await eventually(lambda: next(calls) >= 3 and "done") == "done"

    async def third() -> int:
        return max(0, next(calls) - 5)

    assert await eventually(third) == 1


async def test_eventually_raises_naming_what_it_waited_for_and_the_last_result() -> None:
    with pytest.raises(TimeoutError, match=r"within 0.1 s: the answer \(last: 0\)"):
        await eventually(lambda: 0, 0.1, what="the answer")


async def test_an_exception_from_the_check_ends_the_wait_at_once() -> None:
    def exited() -> bool:
        raise RuntimeError("the process exited")

    with pytest.raises(RuntimeError, match="exited"):
        await eventually(exited, 60)


def test_eventually_sync_has_the_same_contract() -> None:
    calls = itertools.count(1)
    assert eventually_sync(lambda: next(calls) >= 2) is True
    with pytest.raises(TimeoutError, match=r"within 0.05 s: nothing \(last: None\)"):
        eventually_sync(lambda: None, 0.05, what="nothing")
