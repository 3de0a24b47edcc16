"""Minting tokens as ``tokend issue`` does, with the keys a node would sign with."""

from __future__ import annotations

from pathlib import Path

from tokend import config
from tokend.config import Settings
from tokend.tokens import KeyRing, TokenService


def minter(settings: Settings, keys_dir: Path | None = None) -> TokenService:
    """Tokens for a node of ``settings``, signed with its keys (or with those in
    ``keys_dir``, made there if none: a stranger's)."""
    return TokenService(settings, KeyRing.open(keys_dir or settings.resolved_keys_dir))


def minter_in(keys_dir: Path) -> TokenService:
    """Tokens signed with the keys in ``keys_dir`` (made there if none), every other
    setting the default: a harness's own keys."""
    return minter(config.load({"keys_dir": str(keys_dir)}, environ={}))
