"""The live sessions a node holds: its peers by connection id, counted per sub and state.

A peer is registered once its session is WELCOMEd and forgotten when its connection
ends. The counts per sub hold the ``max_sessions_per_sub`` cap (docs/protocol.md §7,
4029 ``too_many_sessions``): a resume of a session held here does not count against it.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator

from tokend.core.claims import Claims
from tokend.core.lifecycle import State
from tokend.server.seams import Peer


class Registry:
    """The peers of one node that hold a session, by connection id; ``max_per_sub`` is the
    cap of sessions per sub (0: none, and no counts are kept)."""

    __slots__ = ("max_per_sub", "peers", "per_sub")

    def __init__(self, max_per_sub: int) -> None:
        self.max_per_sub = max_per_sub
        self.peers: dict[str, Peer] = {}
        # Peers per tid, per sub: kept only under a cap.
        self.per_sub: dict[str, Counter[uuid.UUID]] = {}

    def __len__(self) -> int:
        return len(self.peers)

    def __iter__(self) -> Iterator[Peer]:
        return iter(self.peers.values())

    def get(self, conn: str) -> Peer | None:
        return self.peers.get(conn)

    def attach(self, peer: Peer) -> None:
        """``peer`` was WELCOMEd: it holds its session here."""
        session = peer.session
        assert session.claims is not None
        self.peers[session.conn] = peer
        if self.max_per_sub:
            self.per_sub.setdefault(session.claims.sub, Counter())[session.claims.tid] += 1

    def detach(self, peer: Peer) -> None:
        """``peer``'s connection ended; nothing if it was not registered (or was already
        forgotten: a connection ends once, whatever calls it)."""
        session = peer.session
        if self.peers.get(session.conn) is not peer:
            return
        del self.peers[session.conn]
        if not self.max_per_sub or session.claims is None:
            return
        sub, tid = session.claims.sub, session.claims.tid
        tids = self.per_sub[sub]
        tids[tid] -= 1
        if not tids[tid]:
            del tids[tid]
            if not tids:
                del self.per_sub[sub]

    def other_sessions_of(self, sub: str, tid: uuid.UUID) -> int:
        """Sessions of ``sub`` held here, not counting ``tid`` itself (a resume)."""
        tids = self.per_sub.get(sub)
        return len(tids) - (tid in tids) if tids else 0

    def sub_is_full(self, claims: Claims) -> bool:
        """True when the token's sub may open no further session here."""
        cap = self.max_per_sub
        return bool(cap) and self.other_sessions_of(claims.sub, claims.tid) >= cap

    def sessions_by_state(self) -> dict[str, int]:
        """How many sessions held here are ACTIVE and how many in WARN (for metrics)."""
        warned = sum(1 for peer in self.peers.values() if peer.session.warned)
        return {State.ACTIVE.value: len(self.peers) - warned, State.WARN.value: warned}

    def ranks(self) -> Iterator[int]:
        """The serving rank of every session held here (:mod:`tokend.server.shedding`)."""
        return (peer.session.rank for peer in self.peers.values())
