"""Revocations a node heard, written again after a Redis failover: the second line of defence.

A revocation is reported done once the replicas acknowledged it (``durable_replicas``,
:mod:`tokend.store.durability`); when they did not, ``tokend revoke`` says it is not confirmed,
and a failover may still lose the tombstone. So every node keeps the revocations it hears
(end.lua tells every node, on the revocations channel) until their tombstones would have
expired, and

* refuses the HELLO of a token it knows as revoked without asking Redis (``Store.known_revoked``);
* compares every master's replication id each ``failover_check_interval`` (and whenever its
  subscription is made again): a new id (a replica promoted, a master restarted) means
  acknowledged writes may be gone, and the node revokes again every token it keeps. A
  tombstone that survived is left as it is; a lost one is written again, and a session that
  came back with it is ended (closed as revoked, TOKEN_REVOKED emitted anew).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable

import structlog

from tokend.store.redis_client import Client, close_quietly, subscription
from tokend.store.sessions import Store
from tokend.store.unavailable import UNAVAILABLE, NotConfirmed, Retry, StoreUnavailable

log = structlog.get_logger("tokend.revocations")


class Revocations:
    """The revocations one node keeps, and the task that hears them and re-asserts them."""

    def __init__(self, store: Store, redis: Client, check_interval: float) -> None:
        self.store = store
        self.redis = redis
        self.check_interval = check_interval
        self.known: dict[str, int] = {}  # tid -> when its tombstone expires (unix ms)
        # Each master's replication id as last seen (None: not yet seen).
        self.replication_ids: dict[str, str] | None = None
        self.pending = False  # a failover was seen; not every revocation written again yet
        # Who asks, in the TOKEN_REVOKED of a revocation written again (docs/events.md).
        self.by = f"failover:{store.node}"
        store.known_revoked = self.knows

    def knows(self, tid: str) -> bool:
        expires = self.known.get(tid)
        return expires is not None and expires > time.time() * 1000

    def heard(self, data: str) -> None:
        try:
            message = json.loads(data)
            if message["op"] == "revoked":
                self.known[str(uuid.UUID(message["tid"]))] = int(message["expires"])
        except (ValueError, KeyError, TypeError):
            log.warning("malformed revocation message")

    async def run(self, running: Callable[[], bool]) -> None:
        """Hear revocations and watch for failovers while ``running()``."""
        loop = asyncio.get_running_loop()
        retry = Retry()
        while running():
            pubsub = None
            try:
                pubsub = await subscription(self.redis)
                await pubsub.subscribe(self.store.keys.revocations_channel)
                retry.succeeded()
                next_check = loop.time()  # at once: the subscription may be new after a failover
                while running():
                    if loop.time() >= next_check:
                        await self.check()
                        next_check = loop.time() + self.check_interval
                    wait = max(0.0, next_check - loop.time())
                    message = await pubsub.get_message(timeout=wait)
                    if message is not None:
                        self.heard(message["data"])
            except UNAVAILABLE as exc:
                log.warning("revocations subscription lost", error=type(exc).__name__)
            if pubsub is not None:
                await close_quietly(pubsub)
            await retry.wait()

    async def check(self) -> None:
        """See whether a master changed since the last check; if so (or if the last
        re-assertion did not finish), revoke again every token kept."""
        try:
            seen = await self.store.queries.replication_ids()
        except StoreUnavailable:
            return
        except Exception:  # a bug, or a Cluster in a state redis-py does not expect: retry
            log.exception("failover check failed")
            return
        if self.replication_ids is not None and seen != self.replication_ids:
            log.warning("redis failover or restart seen", masters=len(seen))
            self.pending = True
        self.replication_ids = seen
        if self.pending:
            self.pending = not await self.reassert()

    async def reassert(self) -> bool:
        """Revoke again every token kept; False when some could not be (Redis unreachable)."""
        now_ms = time.time() * 1000
        self.known = {tid: expires for tid, expires in self.known.items() if expires > now_ms}
        results = await asyncio.gather(
            *(self.store.revoke(uuid.UUID(tid), by=self.by) for tid in self.known),
            return_exceptions=True,
        )
        restored = failed = 0
        for result in results:
            if isinstance(result, NotConfirmed):  # written on the master: done here
                result = result.outcome
            if isinstance(result, BaseException):
                failed += 1
                if not isinstance(result, StoreUnavailable):
                    log.error("revocation failed", error=repr(result))
            elif result:  # the tombstone was lost: written again
                restored += 1
        log.warning(
            "revocations written again", kept=len(results), restored=restored, failed=failed
        )
        return not failed
