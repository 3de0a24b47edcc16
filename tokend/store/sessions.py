"""The session store: every session state change, as one script call with a deadline.

HELLOs and heartbeats go in batches (one round trip for many sessions, grouped by shard);
the sweep makes the due transitions (one atomic script per shard); BYE and revocation end a
session. Each call's reply becomes one of :mod:`tokend.core.store_messages`' enums and tuples here,
so that no raw reply leaves this module.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, NamedTuple

import structlog
from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from tokend.config import Settings
from tokend.core.lifecycle import held_live_ms
from tokend.core.protocol import CloseCode
from tokend.core.store_messages import (
    Ended,
    EndOutcome,
    HeartbeatAnswer,
    HeartbeatOutcome,
    HeartbeatReply,
    HeartbeatRequest,
    HelloAnswer,
    HelloOutcome,
    Known,
    ReleaseOutcome,
    SweepAnswer,
    Swept,
    heartbeat_outcome,
)
from tokend.store.keyspace import SHARDS, Keyspace
from tokend.store.queries import Queries
from tokend.store.redis_client import Client, DirectCalls
from tokend.store.scripts import (
    END,
    HEARTBEAT,
    HELLO,
    MOVE,
    RELEASE,
    SWEEP,
    Script,
    ScriptRunner,
)
from tokend.store.unavailable import NotConfirmed
from tokend.tokens.service import store_digest

log = structlog.get_logger("tokend.store")

# One session's part of a batch script call: its shard, its keys, its arguments.
SessionPart = tuple[int, Sequence[str], Sequence[Any]]


def proof_digest(proof: bytes | None) -> str:
    """What the store keeps of a resume proof (spec "Resume proof", revision 2), and what
    hello.lua compares: its :func:`tokend.tokens.service.store_digest`; "" for no proof.

    Not the proof itself: a digest cannot be turned back into a proof, so a copy of Redis
    does not let anyone take over a live session, and an equality of digests in Lua takes
    a time that tells nothing about the proof (docs/security.md). Never logged all the same.
    """
    return store_digest(proof) if proof else ""


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
    # The token's digest (tokend.tokens.service.token_digest), kept with the session when
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


class MoveRequest(NamedTuple):
    """A session to move from connection ``source`` (taken at ``since_ms``) to ``to``
    (move.lua); ``since_ms`` None: ``source`` is a node name, and any of its connections
    counts (a move back from a new worker that died)."""

    tid: str
    source: str
    since_ms: int | None
    to: str
    shard: int

    @classmethod
    def of(cls, tid: uuid.UUID, source: str, since_ms: int | None, to: str) -> MoveRequest:
        tid_text = str(tid)
        return cls(tid_text, source, since_ms, to, Keyspace.shard_of(tid_text))


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
        # The batch scripts' calls, on one Redis (not a Cluster, not through Sentinel).
        self._direct = DirectCalls.usable(redis)
        held_ms = held_live_ms(settings.ms("heartbeat_interval"))
        self._hello_args = [self.warn_ms, self.grace_ms, self.expire_ms, held_ms]
        self._release_args = [self.warn_ms]
        self._heartbeat_args = [
            self.warn_ms,
            self.renew_ms,
            self.ttl_s,
            self.grace_ms,
            self.expire_ms,
        ]
        # heartbeat.lua's batches, written as Redis reads them, on one Redis.
        self._wire = _HeartbeatWire(self) if self._direct is not None else None
        # Whether this node knows the token as revoked (tokend.store.revocations sets it): such a
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
    ) -> list[HeartbeatReply]:
        """Record many heartbeats in one round trip (two when Redis lost some sessions).

        ``replayed[i]`` marks a heartbeat received in time but stored late (after an
        outage): the script does not judge it for silence. One heartbeat.lua call for
        the whole batch on one Redis; on a Cluster, one per shard (a call's keys must be
        of one slot there). A plain OK is answered by the session's exp_ms alone
        (:data:`tokend.core.store_messages.HeartbeatReply`).

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
            if type(answer) is int:
                continue
            assert isinstance(answer, HeartbeatAnswer)
            outcome = answer.outcome
            if outcome is _OK or (outcome is HeartbeatOutcome.GONE and answer.ended is not None):
                continue
            what = known(i)
            if what is not None and what.since_ms:
                again.append(i)
                knowledge.append(_restore_argument(what))
        if again:
            retried = await self._beat(
                [batch[i] for i in again],
                [bool(replayed) and replayed[i] for i in again],
                knowledge,
            )
            for i, answer in zip(again, retried, strict=True):
                answers[i] = answer
                if heartbeat_outcome(answer) is _OK:
                    log.warning("session restored", tid=batch[i].tid, conn=batch[i].conn)
        return answers

    async def _beat(
        self, batch: Sequence[HeartbeatRequest], replayed: Sequence[bool], restore: Sequence[str]
    ) -> list[HeartbeatReply]:
        """One heartbeat.lua round trip for ``batch``: on one Redis, written as Redis reads
        it (:class:`_HeartbeatWire`); else its sessions grouped by shard as they are read,
        each value written once into its group's keys and arguments."""
        wire = self._wire
        if wire is not None:
            packed, order = wire.pack(batch, replayed, restore, self._given_up_at())
            replies = await self._direct_call(HEARTBEAT, packed)
            # Back in the batch's order: replies[j] is batch[order[j]]'s.
            if len(replies) > 1:
                replies = itemgetter(*sorted(range(len(order)), key=order.__getitem__))(replies)
            # heartbeat.lua's common reply, an integer, is an answer as it is.
            return [r if type(r) is int else _heartbeat_answer(r) for r in replies]
        prefixes = self._session_prefixes
        shard_keys = self._shard_keys
        groups: dict[int, _Group] = {}
        for i, (tid, conn, shard, token) in enumerate(batch):
            group = groups.get(shard)
            if group is None:
                group = groups[shard] = _Group(shard_keys[shard])
            hash_prefix, tomb_prefix = prefixes[shard]
            group.keys += (hash_prefix + tid, tomb_prefix + tid)
            group.args += (
                tid,
                conn,
                "1" if replayed and replayed[i] else "0",
                restore[i] if restore else "",
                token,
            )
            group.positions.append(i)
        replies = await self._run_groups(HEARTBEAT, self._heartbeat_args, groups, len(batch))
        # heartbeat.lua's common reply, an integer, is an answer as it is.
        return [r if type(r) is int else _heartbeat_answer(r) for r in replies]

    async def _per_shard(
        self, script: Script, fixed: list[Any], members: Sequence[SessionPart]
    ) -> list[Any]:
        """Run a batch script (hello or release.lua) for many sessions in one round trip.

        ``members`` are (shard, the session's keys, its arguments), grouped by shard for
        :meth:`_run_groups`. Returns the script's replies in the order of ``members``.
        """
        groups: dict[int, _Group] = {}
        for i, (shard, keys, args) in enumerate(members):
            group = groups.get(shard)
            if group is None:
                group = groups[shard] = _Group(self._shard_keys[shard])
            group.keys += keys
            group.args += args
            group.positions.append(i)
        return await self._run_groups(script, fixed, groups, len(members))

    async def _run_groups(
        self, script: Script, fixed: list[Any], groups: dict[int, _Group], count: int
    ) -> list[Any]:
        """Run a batch script for the sessions of ``groups`` (one per shard), ``count`` in all.

        The script takes them in groups: the group's keys (the shard's deadline set and
        stream, then its sessions' keys) and its arguments (the number of sessions, then
        theirs), after the ``fixed`` arguments. On one Redis, one call holds every group;
        on a Cluster, one call per group (a call's keys must be of one slot). Returns the
        script's replies in the order of the sessions' positions.
        """
        parts = list(groups.values())
        if self._one_slot_per_call:
            calls = [(script, g.keys, [*fixed, len(g.positions), *g.args]) for g in parts]
        elif len(parts) == 1:
            g = parts[0]
            calls = [(script, g.keys, [*fixed, len(g.positions), *g.args])]
        elif parts:
            keys: list[str] = []
            args = fixed[:]
            for g in parts:
                keys += g.keys
                args.append(len(g.positions))
                args += g.args
            calls = [(script, keys, args)]
        else:
            return []
        if self._direct is not None and len(calls) == 1:
            replies = await self._eval_direct(*calls[0])
        else:
            answered = await self._eval_many(calls)
            replies = answered[0] if len(answered) == 1 else [r for c in answered for r in c]
        if len(parts) == 1:
            return replies  # one group: its positions are the batch's, in order
        results: list[Any] = [None] * count
        at = 0
        for g in parts:
            for i in g.positions:
                results[i] = replies[at]
                at += 1
        return results

    async def _eval_direct(self, script: Script, keys: list[str], args: list[Any]) -> list[Any]:
        """One batch script call on one Redis, through :class:`DirectCalls` (no pool, no
        pipeline): what ``_eval_many`` does for one call, NOSCRIPT and errors alike."""
        command = ("EVALSHA", script.sha, len(keys), *keys, *self._common, *args)
        return await self._direct_call(script, None, command)

    async def _direct_call(
        self, script: Script, packed: bytes | None, command: tuple[Any, ...] = ()
    ) -> list[Any]:
        """A batch script's call through :class:`DirectCalls`, written already (``packed``)
        or not (``command``)."""
        direct = self._direct
        assert direct is not None
        try:
            reply = await self._timed(
                script.name,
                lambda: self._reloading(script, lambda: direct.call_packed(packed, command)),
            )
        except rexc.ResponseError as exc:
            raise RuntimeError(f"script failed: {exc}") from None
        return self._answered(reply)

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

    async def moves(self, batch: Sequence[MoveRequest]) -> list[int]:
        """Move each session of ``batch`` from one connection to another in one round trip
        (move.lua), only while the first still holds it: per session, the Redis time at
        which the second took it (its ``since``), or 0 when the first did not hold it."""
        prefixes = self._session_prefixes
        members = []
        for tid, source, since_ms, to, shard in batch:
            hash_prefix, tomb_prefix = prefixes[shard]
            since = "" if since_ms is None else since_ms
            members.append(
                (shard, (hash_prefix + tid, tomb_prefix + tid), (tid, source, since, to))
            )
        return [int(reply) for reply in await self._per_shard(MOVE, [], members)]

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

    async def sweep(self, limit: int, since_ms: int = 0) -> SweepAnswer:
        """Make the due transitions of every shard, up to ``limit`` due sessions a shard:
        one sweep.lua call per shard (finding and judging in one atomic step), all in one
        round trip. ``since_ms``: when this node began sweeping (Redis time; 0: now), which
        holds parked sessions for a while (tokend.core.lifecycle.parked_hold)."""
        calls = [
            (
                SWEEP,
                self._shard_keys[n],
                [limit, self.warn_ms, self.expire_ms, since_ms, *prefixes],
            )
            for n, prefixes in enumerate(self._session_prefixes)
        ]
        now, made, upcoming, full = 0, [], [], False
        for reply in await self._eval_many(calls):
            now = max(now, int(reply[0]))
            if reply[1]:
                upcoming.append(int(float(reply[1])))
            full = full or int(reply[2]) >= limit
            for i in range(3, len(reply), 3):
                made.append((reply[i], Swept(reply[i + 1]), reply[i + 2]))
        return SweepAnswer(now, made, min(upcoming, default=None), full)

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


class _HeartbeatWire:
    """heartbeat.lua's EVALSHA for a batch on one Redis, written as Redis reads it (RESP:
    an array of bulk strings) rather than argument by argument by hiredis' packer, whose
    work per argument a heartbeat's seven arguments would each pay
    (bench/hotpath_profile.py profiles it).

    The sessions go in groups by shard (``for_each_session`` in lua/_prelude.lua), in
    the order of their shards: a group per session would cost Redis a group's setup on
    every heartbeat. What a session adds is two string formats of parts made here once
    per shard.
    """

    def __init__(self, store: Store) -> None:
        keys = store.keys
        # Per shard: its deadline set and stream; the head of a session hash key (the
        # tid follows), and the tombstone key's head.
        self.shards = ["".join(map(_bulk, keys.shard_keys(shard))) for shard in range(SHARDS)]
        self.heads: list[str] = []
        self.mids: list[str] = []
        for shard in range(SHARDS):
            hash_prefix, tomb_prefix = keys.session_prefixes(shard)
            self.heads.append(_bulk_head(hash_prefix, TID_TEXT))
            self.mids.append("\r\n" + _bulk_head(tomb_prefix, TID_TEXT))
        self.evalsha = "$7\r\nEVALSHA\r\n" + _bulk(HEARTBEAT.sha)
        self.prelude = "".join(map(_bulk, store._prelude_args))
        self.fixed = "".join(_bulk(str(arg)) for arg in store._heartbeat_args)

    def pack(
        self,
        batch: Sequence[HeartbeatRequest],
        replayed: Sequence[bool],
        restore: Sequence[str],
        given_up_at: str,
    ) -> tuple[bytes, list[int]]:
        """The command for ``batch`` (see Store._beat), its deadline ``given_up_at``; and
        the positions in ``batch`` of the sessions in the order it names them (that of
        the script's replies)."""
        count = len(batch)
        # Per shard: its sessions' keys, arguments and positions in the batch.
        keys: list[list[str]] = [[] for _ in range(SHARDS)]
        args: list[list[str]] = [[] for _ in range(SHARDS)]
        places: list[list[int]] = [[] for _ in range(SHARDS)]
        heads, mids = self.heads, self.mids
        for i, (tid, conn, shard, token) in enumerate(batch):
            keys[shard].append(f"{heads[shard]}{tid}{mids[shard]}{tid}\r\n")
            places[shard].append(i)
            if token or restore or (replayed and replayed[i]):
                args[shard].append(
                    _bulk(tid)
                    + _bulk(conn)
                    + _bulk("1" if replayed and replayed[i] else "0")
                    + _bulk(restore[i] if restore else "")
                    + _bulk(token)
                )
            else:  # the common case: not replayed, nothing to restore, no token
                size = len(conn) if conn.isascii() else len(conn.encode())
                args[shard].append(f"${TID_TEXT}\r\n{tid}\r\n${size}\r\n{conn}{_PLAIN_END}")
        key_parts: list[str] = []
        arg_parts = [self.prelude, _bulk(given_up_at), self.fixed]
        order: list[int] = []
        groups = 0
        for shard, members in enumerate(places):
            if members:
                groups += 1
                size = len(members)
                key_parts.append(self.shards[shard])
                key_parts += keys[shard]
                arg_parts.append(_COUNTS[size] if size < _COUNTED else _bulk(str(size)))
                arg_parts += args[shard]
                order += members
        key_count = 2 * (groups + count)  # a group's shard keys, a session's two
        # EVALSHA, its sha, the key count, the keys; the prelude's 5 and the fixed 5
        # arguments, a count a group, 5 a session.
        head = f"*{3 + key_count + 10 + groups + 5 * count}\r\n"
        packed = "".join([head, self.evalsha, _bulk(str(key_count)), *key_parts, *arg_parts])
        return packed.encode(), order


def _bulk(text: str) -> str:
    """``text`` as a RESP bulk string (its length in UTF-8 bytes)."""
    return f"{_bulk_head(text, 0)}\r\n"


def _bulk_head(start: str, more: int) -> str:
    """A bulk string's head and its first part, ``start``: ``more`` characters (ASCII)
    follow to end it."""
    return f"${len(start.encode()) + more}\r\n{start}"


# A tid's canonical text (str(uuid.UUID)) is this long, in ASCII.
TID_TEXT = 36
# A group's count of sessions, written once (up to a batch's usual size).
_COUNTED = 1024
_COUNTS = [_bulk(str(n)) for n in range(_COUNTED)]
_PLAIN_END = "\r\n" + _bulk("0") + _bulk("") + _bulk("")  # not replayed, no restore, no token


class _Group:
    """One shard's part of a batch script call: its keys and arguments, and the positions
    of its sessions in the batch."""

    __slots__ = ("args", "keys", "positions")

    def __init__(self, shard_keys: list[str]) -> None:
        self.keys = shard_keys[:]  # the shard's deadline set and stream, then its sessions'
        self.args: list[Any] = []
        self.positions: list[int] = []


def _restore_argument(known: Known) -> str:
    """heartbeat.lua's restore argument: what a live connection knows of its session."""
    proof = proof_digest(known.proof)
    return f"{known.prio}|{known.iat_s}|{known.exp_ms}|{known.since_ms}|{proof}|{known.sub}"


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


def _heartbeat_answer(reply: list[Any]) -> HeartbeatAnswer:
    """heartbeat.lua's reply other than a plain OK's (an integer)."""
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
