"""The live sessions a node holds: its links by connection id, counted per sub and state.

A link is registered once its session is WELCOMEd and forgotten when its connection
ends. The counts per sub hold the ``max_sessions_per_sub`` cap (docs/protocol.md §7,
4029 ``too_many_sessions``): a resume of a session held here does not count against it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

from tokend.core.claims import Claims
from tokend.core.lifecycle import State
from tokend.server import seams


class Registry:
    """The links of one node that hold a session, by connection id; ``max_per_sub`` is the
    cap of sessions per sub (0: none, and no counts are kept)."""

    __slots__ = ("links", "max_per_sub", "per_sub")

    def __init__(self, max_per_sub: int) -> None:
        self.max_per_sub = max_per_sub
        self.links: dict[str, seams.SessionLink] = {}
        # Links per tid, per sub: kept only under a cap. A tid by its int, hashed in C (a
        # UUID's hash is a Python call, made several times per connection here).
        self.per_sub: dict[str, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.links)

    def __iter__(self) -> Iterator[seams.SessionLink]:
        return iter(self.links.values())

    def get(self, conn: str) -> seams.SessionLink | None:
        return self.links.get(conn)

    def attach(self, link: seams.SessionLink) -> None:
        """``link`` was WELCOMEd: it holds its session here."""
        session = link.session
        claims = session.claims
        assert claims is not None
        self.links[session.conn] = link
        if self.max_per_sub:
            tids = self.per_sub.get(claims.sub)
            if tids is None:
                tids = self.per_sub[claims.sub] = {}
            tid = claims.tid.int
            tids[tid] = tids.get(tid, 0) + 1

    def detach(self, link: seams.SessionLink) -> None:
        """``link``'s connection ended; nothing if it was not registered (or was already
        forgotten: a connection ends once, whatever calls it)."""
        session = link.session
        if self.links.get(session.conn) is not link:
            return
        del self.links[session.conn]
        claims = session.claims
        if not self.max_per_sub or claims is None:
            return
        tids = self.per_sub[claims.sub]
        tid = claims.tid.int
        left = tids[tid] - 1
        if left:
            tids[tid] = left
            return
        del tids[tid]
        if not tids:
            del self.per_sub[claims.sub]

    def other_sessions_of(self, sub: str, tid: uuid.UUID) -> int:
        """Sessions of ``sub`` held here, not counting ``tid`` itself (a resume)."""
        tids = self.per_sub.get(sub)
        return len(tids) - (tid.int in tids) if tids else 0

    def sub_is_full(self, claims: Claims) -> bool:
        """True when the token's sub may open no further session here."""
        cap = self.max_per_sub
        return bool(cap) and self.other_sessions_of(claims.sub, claims.tid) >= cap

    def sessions_by_state(self) -> dict[str, int]:
        """How many sessions held here are ACTIVE and how many in WARN (for metrics)."""
        warned = sum(1 for link in self.links.values() if link.session.warned)
        return {State.ACTIVE.value: len(self.links) - warned, State.WARN.value: warned}

    def ranks(self) -> Iterator[int]:
        """The serving rank of every session held here (:mod:`tokend.server.shedding`)."""
        return (link.session.rank for link in self.links.values())
