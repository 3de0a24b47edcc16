"""The session store: every session state change, as one script call with a deadline.

HELLOs and heartbeats go in batches (one round trip for many sessions, grouped by shard);
the sweep claims due sessions and makes their transitions; BYE and revocation end a
session. Each call's reply becomes one of :mod:`tokend.answers`' enums and tuples here,
so that no raw reply leaves this module.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import structlog
from redis.asyncio.cluster import RedisCluster

from tokend.answers import (
    Ended,
    EndOutcome,
    HeartbeatAnswer,
    HeartbeatOutcome,
    HelloAnswer,
    HelloOutcome,
    ReleaseOutcome,
    Swept,
)
from tokend.clocks import HELD_LIVE_SLACK_MS
from tokend.config import Settings
from tokend.protocol import CloseCode
from tokend.store.keyspace import SHARDS, Keyspace
from tokend.store.queries import Queries
from tokend.store.redis_client import Client
from tokend.store.scripts import (
    CLAIM,
    END,
    HEARTBEAT,
    HELLO,
    RELEASE,
    TRANSITION,
    Script,
    ScriptRunner,
)
from tokend.store.unavailable import NotConfirmed

log = structlog.get_logger("tokend.store")

# One session's part of a batch script call: its shard, its keys, its arguments.
SessionPart = tuple[int, Sequence[str], Sequence[Any]]


def proof_digest(proof: bytes | None) -> str:
    """What the store keeps of a resume proof (spec "Resume proof", revision 2), and what
    hello.lua compares: the first 16 bytes of its SHA-256, in hex; "" for no proof.

    Not the proof itself: a digest cannot be turned back into a proof, so a copy of Redis
    does not let anyone take over a live session, and an equality of digests in Lua takes
    a time that tells nothing about the proof (docs/security.md). Never logged all the same.
    """
    return hashlib.sha256(proof).hexdigest()[:32] if proof else ""


class HelloRequest(NamedTuple):
    """A HELLO for hello.lua."""

    tid: uuid.UUID
    sub: str
    prio: int
    iat_s: int
    exp_s: int
    conn: str
    # The resume proof the HELLO shows (None: a v1 HELLO without one), and the proof that
    # this connection's session key makes, which the next resume of the session must show.
    shown: bytes | None = None
    proof: bytes = b""
    # The token's digest (tokend.tokens.token_digest), kept with the session when
    # ``verified``; when not (its signature unchecked), the HELLO goes on only if the
    # session keeps this digest, else it is answered VERIFY.
    token: str = ""
    verified: bool = True


class ReleaseRequest(NamedTuple):
    """A connection that held its session ended (release.lua)."""

    tid: str
    conn: str
    since_ms: int  # Redis time at which the connection took the session (HELLO's answer)
    reason: str  # the close reason of a planned close (1001 from the server), else ""
    shard: int


class HeartbeatRequest(NamedTuple):
    """A connection's heartbeat for the batch; built once per connection, reused.

    Small on purpose: every idle session keeps one. Its keys are made at each flush.
    """

    tid: str
    conn: str
    shard: int


class Known(NamedTuple):
    """What a live connection knows of its session: enough for heartbeat.lua to restore
    it should a failover have lost it (or lost this connection's resume of it)."""

    sub: str
    prio: int
    iat_s: int
    exp_ms: int
    since_ms: int  # Redis time at which this connection took the session (HELLO's answer)
    proof: bytes  # the resume proof this connection's session key makes

    @property
    def encoded(self) -> str:
        """heartbeat.lua's restore argument."""
        proof = proof_digest(self.proof)
        return f"{self.prio}|{self.iat_s}|{self.exp_ms}|{self.since_ms}|{proof}|{self.sub}"


class Store(ScriptRunner):
    """Every session state change of one node, as one script call with a deadline; its
    read-only queries (admin API, CLI) are :attr:`queries`."""

    def __init__(self, redis: Client, settings: Settings, node: str) -> None:
        super().__init__(redis, settings, node)
        self.queries = Queries(redis, self.keys, self.deadline)
        self.warn_ms = settings.ms("warn_after")
        self.expire_ms = settings.ms("expire_after")
        self.renew_ms = settings.ms("renew_window")
        self.ttl_s = settings.token_ttl_s
        # The session hash outlives its token by this much, so that a late sweep
        # still finds it and emits TOKEN_EXPIRED instead of losing it to PEXPIREAT.
        self.grace_ms = self.expire_ms
        self._shard_keys = [self.keys.shard_keys(n) for n in range(SHARDS)]
        self._session_prefixes = [self.keys.session_prefixes(n) for n in range(SHARDS)]
        # A Cluster refuses a call whose keys span slots (CROSSSLOT).
        self._one_slot_per_call = isinstance(redis, RedisCluster)
        held_live_ms = settings.ms("heartbeat_interval") + HELD_LIVE_SLACK_MS
        self._hello_args = [self.warn_ms, self.grace_ms, self.expire_ms, held_live_ms]
        self._release_args = [self.warn_ms, settings.ms("restart_grace")]
        self._heartbeat_args = [
            self.warn_ms,
            self.renew_ms,
            self.ttl_s,
            self.grace_ms,
            self.expire_ms,
        ]
        # Whether this node knows the token as revoked (tokend.revocations sets it): such a
        # HELLO is refused without asking Redis, which a failover may have made forget it.
        self.known_revoked: Callable[[str], bool] = _never

    async def hello(
        self,
        tid: uuid.UUID,
        sub: str,
        prio: int,
        iat_s: int,
        exp_s: int,
        conn: str,
        shown: bytes | None = None,
        proof: bytes = b"",
        token: str = "",
        verified: bool = True,
    ) -> HelloAnswer:
        """Start or resume one session (hello.lua); see :class:`HelloRequest`."""
        request = HelloRequest(tid, sub, prio, iat_s, exp_s, conn, shown, proof, token, verified)
        return (await self.hellos([request]))[0]

    async def hellos(self, batch: Sequence[HelloRequest]) -> list[HelloAnswer]:
        """Start or resume many sessions in one round trip: one hello.lua call on one
        Redis, one per shard on a Cluster (see :meth:`_per_shard`).

        In a connect storm a round trip per HELLO, with its pool checkout and deadline,
        costs more than the script itself; the node sends the HELLOs that arrive while
        one round trip is out together in the next.
        """
        if any(self.known_revoked(str(request[0])) for request in batch):
            # Refused without asking Redis, which a failover may have made forget them.
            return await self._hellos_but_revoked(batch)
        prefixes = self._session_prefixes
        members = []
        for tid, sub, prio, iat_s, exp_s, conn, shown, proof, token, verified in batch:
            tid_text = str(tid)
            shard = Keyspace.shard_of(tid_text)
            hash_prefix, tomb_prefix = prefixes[shard]
            members.append(
                (
                    shard,
                    (hash_prefix + tid_text, tomb_prefix + tid_text),
                    (
                        tid_text,
                        sub,
                        prio,
                        iat_s,
                        exp_s,
                        conn,
                        proof_digest(shown),
                        proof_digest(proof),
                        token,
                        "1" if verified else "0",
                    ),
                )
            )
        replies = await self._per_shard(HELLO, self._hello_args, members)
        return [_hello_answer(reply) for reply in replies]

    async def _hellos_but_revoked(self, batch: Sequence[HelloRequest]) -> list[HelloAnswer]:
        """:meth:`hellos`, answering those this node knows as revoked itself (a token not
        verified yet is told to verify first: a revocation is told to its token only)."""
        barred = [self.known_revoked(str(request[0])) for request in batch]
        asked = iter(await self.hellos([r for r, b in zip(batch, barred, strict=True) if not b]))
        return [
            (_REVOKED if r.verified else _VERIFY) if b else next(asked)
            for r, b in zip(batch, barred, strict=True)
        ]

    def heartbeat_request(self, tid: uuid.UUID, conn: str) -> HeartbeatRequest:
        tid_text = str(tid)
        return HeartbeatRequest(tid_text, conn, Keyspace.shard_of(tid_text))

    async def record_heartbeats(
        self,
        batch: Sequence[HeartbeatRequest],
        replayed: Sequence[bool] = (),
        known: Callable[[int], Known | None] | None = None,
    ) -> list[HeartbeatAnswer]:
        """Record many heartbeats in one round trip (two when Redis lost some sessions).

        ``replayed[i]`` marks a heartbeat received in time but stored late (after an
        outage): the script does not judge it for silence. One heartbeat.lua call for
        the whole batch on one Redis; on a Cluster, one per shard (a call's keys must be
        of one slot there).

        A session the store answers gone without a tombstone, or taken, is asked about
        again with what its connection knows (``known(i)``): Redis may have lost it, or
        this connection's resume of it, in a failover; heartbeat.lua then restores it
        (SESSION_RESTORED, docs/scaling.md "What survives a failover").
        """
        answers = await self._beat(batch, replayed, ())
        if known is None:
            return answers
        again, knowledge = [], []
        for i, answer in enumerate(answers):
            outcome = answer.outcome
            if outcome is _OK or (outcome is HeartbeatOutcome.GONE and answer.ended is not None):
                continue
            what = known(i)
            if what is not None and what.since_ms:
                again.append(i)
                knowledge.append(what.encoded)
        if again:
            retried = await self._beat(
                [batch[i] for i in again],
                [bool(replayed) and replayed[i] for i in again],
                knowledge,
            )
            for i, answer in zip(again, retried, strict=True):
                answers[i] = answer
                if answer.outcome is _OK:
                    log.warning("session restored", tid=batch[i].tid, conn=batch[i].conn)
        return answers

    async def _beat(
        self, batch: Sequence[HeartbeatRequest], replayed: Sequence[bool], restore: Sequence[str]
    ) -> list[HeartbeatAnswer]:
        prefixes = self._session_prefixes
        members = []
        for i, (tid, conn, shard) in enumerate(batch):
            hash_prefix, tomb_prefix = prefixes[shard]
            members.append(
                (
                    shard,
                    (hash_prefix + tid, tomb_prefix + tid),
                    (
                        tid,
                        conn,
                        "1" if replayed and replayed[i] else "0",
                        restore[i] if restore else "",
                    ),
                )
            )
        replies = await self._per_shard(HEARTBEAT, self._heartbeat_args, members)
        return [_heartbeat_answer(reply) for reply in replies]

    async def _per_shard(
        self, script: Script, fixed: list[Any], members: Sequence[SessionPart]
    ) -> list[Any]:
        """Run a batch script (hello, heartbeat or release.lua) for many sessions in one round trip.

        ``members`` are (shard, the session's keys, its arguments). The script takes
        them in groups, one per shard: the group's keys (the shard's deadline set and
        stream, then its sessions' keys) and its arguments (the number of sessions, then
        theirs), after the ``fixed`` arguments. On one Redis, one call holds every
        group; on a Cluster, one call per group (a call's keys must be of one slot).
        Returns the script's replies in the order of ``members``.
        """
        groups: dict[int, tuple[list[str], list[Any], list[int]]] = {}
        for i, (shard, keys, args) in enumerate(members):
            group = groups.get(shard)
            if group is None:
                group = groups[shard] = (self._shard_keys[shard][:], [0], [])
            group[0].extend(keys)
            group[1].extend(args)
            group[2].append(i)
        for _, args, positions in groups.values():
            args[0] = len(positions)
        parts = list(groups.values())
        batches = (
            [[part] for part in parts] if self._one_slot_per_call else [parts] if parts else []
        )
        calls = [
            (
                script,
                [key for keys, _, _ in b for key in keys],
                fixed + [arg for _, args, _ in b for arg in args],
            )
            for b in batches
        ]
        replies = (reply for call in await self._eval_many(calls) for reply in call)
        order = (i for _, _, positions in groups.values() for i in positions)
        results: list[Any] = [None] * len(members)
        for i, reply in zip(order, replies, strict=True):
            results[i] = reply
        return results

    def release_request(
        self, tid: uuid.UUID, conn: str, since_ms: int, reason: str
    ) -> ReleaseRequest:
        tid_text = str(tid)
        return ReleaseRequest(tid_text, conn, since_ms, reason, Keyspace.shard_of(tid_text))

    async def releases(self, batch: Sequence[ReleaseRequest]) -> list[ReleaseOutcome]:
        """Record, in one round trip, that the connections of ``batch`` ended: each session
        still held by its connection is held by none now, and one that the server closed
        with 1001 is parked (release.lua; docs/protocol.md §5, "When a connection ends")."""
        prefixes = self._session_prefixes
        members = []
        for tid, conn, since_ms, reason, shard in batch:
            hash_prefix, tomb_prefix = prefixes[shard]
            members.append(
                (shard, (hash_prefix + tid, tomb_prefix + tid), (tid, conn, since_ms, reason))
            )
        replies = await self._per_shard(RELEASE, self._release_args, members)
        return [ReleaseOutcome(reply) for reply in replies]

    async def end(
        self,
        tid: uuid.UUID,
        *,
        conn: str,
        event: str,
        tomb: str,
        code: CloseCode | None,
        by: str = "",
    ) -> EndOutcome:
        """BYE (``conn`` set, no code) or revocation (``conn`` empty, code TOKEN_REVOKED,
        ``by`` who asked).

        Returns end.lua's outcome once ``durable_replicas`` replicas hold it; raises
        :class:`NotConfirmed` when they did not acknowledge it in time (a BYE that
        recorded nothing has nothing to confirm).
        """
        code_arg = "" if code is None else int(code)
        args = [str(tid), conn, event, tomb, code_arg, self.ttl_s * 1000, by]
        reply, acknowledged, wanted = await self._eval_durably(
            END, self.keys.script_keys(tid), args
        )
        outcome = EndOutcome(reply)
        if acknowledged < wanted and not (conn and not outcome):
            raise NotConfirmed(outcome, acknowledged, wanted, self.durable_timeout)
        return outcome

    async def claim_due(self, limit: int, lease_ms: int) -> tuple[int, list[list[str]], int | None]:
        """Claim due sessions of every shard.

        Returns Redis time, the claimed tids by shard, and the earliest deadline left
        in any shard (None when no session is left to judge).
        """
        calls = [(CLAIM, self.keys.shard_keys(n), [limit, lease_ms]) for n in range(SHARDS)]
        replies = await self._eval_many(calls)
        upcoming = [int(float(reply[2])) for reply in replies if reply[2]]
        return (
            max(int(reply[0]) for reply in replies),
            [reply[1] for reply in replies],
            min(upcoming, default=None),
        )

    async def transitions(self, claimed: Sequence[Sequence[str]]) -> list[tuple[str, Swept, str]]:
        """Judge the claimed sessions (tids by shard) and make the transitions due.

        One script call per shard (transition.lua), all in one round trip. Returns the
        transitions made, as (tid, what, conn): ``conn`` is the connection of this node
        to warn or close (the script sends no control message for it), or "".
        """
        calls, tids = [], []
        for shard, shard_tids in enumerate(claimed):
            if shard_tids:
                keys = self._shard_keys[shard][:]
                for tid in shard_tids:
                    keys += self.keys.session_keys_of(shard, tid)
                calls.append((TRANSITION, keys, [self.warn_ms, self.expire_ms, *shard_tids]))
                tids += shard_tids
        made = []
        replies = (reply for shard in await self._eval_many(calls) for reply in shard)
        for tid, reply in zip(tids, replies, strict=True):
            if reply:
                made.append((tid, Swept(reply[0]), reply[1]))
        return made

    async def revoke(self, tid: uuid.UUID, by: str) -> EndOutcome:
        """Revoke a token: its session ends wherever it is (close TOKEN_REVOKED) and it is
        barred.

        ``by`` names who asked, in the TOKEN_REVOKED event (docs/events.md). Raises
        :class:`NotConfirmed` as :meth:`end` does.
        """
        return await self.end(
            tid,
            conn="",
            event="TOKEN_REVOKED",
            tomb=Ended.REVOKED,
            code=CloseCode.TOKEN_REVOKED,
            by=by,
        )


def _never(tid: str) -> bool:
    return False


_REVOKED = HelloAnswer(HelloOutcome.ENDED, ended=Ended.REVOKED)
_VERIFY = HelloAnswer(HelloOutcome.VERIFY)


def _hello_answer(reply: list[Any]) -> HelloAnswer:
    outcome = HelloOutcome(reply[0])
    if outcome is HelloOutcome.STARTED or outcome is HelloOutcome.RESUMED:
        return HelloAnswer(outcome, int(reply[1]), int(reply[2]), int(reply[3]))
    if outcome is HelloOutcome.ENDED:
        return HelloAnswer(outcome, ended=_ended(reply[1]))
    return HelloAnswer(outcome)


_TAKEN = HeartbeatAnswer(HeartbeatOutcome.TAKEN)
_OK = HeartbeatOutcome.OK


def _heartbeat_answer(reply: int | list[Any]) -> HeartbeatAnswer:
    if type(reply) is int:  # stored; only the exp, and iat unchanged (heartbeat.lua)
        return HeartbeatAnswer(_OK, False, False, reply)
    assert isinstance(reply, list)
    if reply[0] == _OK:
        return HeartbeatAnswer(_OK, bool(reply[1]), bool(reply[2]), int(reply[3]), int(reply[4]))
    if reply[0] == HeartbeatOutcome.GONE:
        return HeartbeatAnswer(HeartbeatOutcome.GONE, ended=_ended(reply[1]))
    return _TAKEN


def _ended(tomb: str) -> Ended | None:
    """A tombstone's reason; None for none (or one this version does not know)."""
    try:
        return Ended(tomb)
    except ValueError:
        return None
