"""The kit of the pure parts' tests (session core, client core): a clock the test moves
by hand and tokens on a key ring in the test's own directory; no Redis, no socket.

The fixtures are imported by the test modules that use them (``from testkit.pure
import clock, tokens``); tests/conftest.py's ``tokens`` needs a Redis, these do not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.tokens import WallClockTokens, minter_in


class FakeClock:
    """A monotonic clock that moves only when the test sets :attr:`now`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def tokens(tmp_path: Path) -> WallClockTokens:
    """Tokens signed and verified with a key ring in ``tmp_path / "keys"``."""
    return minter_in(tmp_path / "keys")
