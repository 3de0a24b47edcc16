"""Minting tokens as ``tokend issue`` does, with the keys a node would sign with."""

from __future__ import annotations

import time
from pathlib import Path

from tokend import config
from tokend.config import Settings
from tokend.core.claims import Claims
from tokend.tokens.keys import KeyRing
from tokend.tokens.service import TokenService


class WallClockTokens(TokenService):
    """A :class:`TokenService` that reads a token the server just gave as a client of
    the keys directory would: :meth:`verify` first follows the directory (keys a node
    rotated in), and checks times against the wall clock unless given ``now``."""

    def verify(self, token: str, now: float | None = None) -> Claims:
        self.keys.refresh()
        return super().verify(token, time.time() if now is None else now)


def minter(settings: Settings, keys_dir: Path | None = None) -> WallClockTokens:
    """Tokens for a node of ``settings``, signed with its keys (or with those in
    ``keys_dir``, made there if none: a stranger's)."""
    return WallClockTokens(settings, KeyRing.open(keys_dir or settings.resolved_keys_dir))


def minter_in(keys_dir: Path) -> WallClockTokens:
    """Tokens signed with the keys in ``keys_dir`` (made there if none), every other
    setting the default: a harness's own keys."""
    return minter(config.load({"keys_dir": str(keys_dir)}, environ={}))
