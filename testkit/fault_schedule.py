"""The fault schedule of a fault run (load_tests/faults.py): a pure function of a seed.

Every fault and every deliberate client action of a run is drawn here, up front, from
``random.Random(seed)``: the same seed gives the same schedule, so a failing seed runs
the same faults again. Times are seconds from the start of the run's fault phase.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

# Faults of a node, of Redis, of the links between them, and actions of clients.
NODE_KILL = "node_kill"  # SIGKILL a node, start it again after `duration`
NODE_PAUSE = "node_pause"  # SIGSTOP a node for `duration` (longer than warn_after), SIGCONT
NODE_RELOAD = "node_reload"  # SIGHUP the supervisor node: a rolling reload
REDIS_FAILOVER = "redis_failover"  # SIGKILL the master; Sentinel promotes the replica
NODE_REDIS_CUT = "node_redis_cut"  # a node's Redis connections reset, new ones refused
NODE_REDIS_DELAY = "node_redis_delay"  # what a node sends Redis delayed by `amount` s
CLIENT_CUT = "client_cut"  # clients' connections to a node reset, new ones go elsewhere
CLIENT_DROP = "client_drop"  # clients' open connections to a node silently drop bytes
CLIENT_DELAY = "client_delay"  # what clients send a node delayed by `amount` s
REVOKE = "revoke"  # an operator revokes a session (`tokend revoke` or the admin API)
LOGOUT = "logout"  # a client says BYE
SILENCE = "silence"  # a client goes silent for good: its session must expire, once
TAKEOVER = "takeover"  # a second client resumes the session with its proof

NODE_FAULTS = (NODE_KILL, NODE_PAUSE, NODE_REDIS_CUT, NODE_REDIS_DELAY)
LINK_FAULTS = (CLIENT_CUT, CLIENT_DROP, CLIENT_DELAY)
SESSION_ACTIONS = (REVOKE, LOGOUT, SILENCE, TAKEOVER)
KINDS = (*NODE_FAULTS, NODE_RELOAD, REDIS_FAILOVER, *LINK_FAULTS, *SESSION_ACTIONS)
NODES = 3  # tokend nodes in a run
# Node 0 is a supervisor with workers (it reloads); SIGKILL and SIGSTOP go to the
# single-process nodes, whose death takes no orphaned workers along.
RELOADING_NODE = 0


@dataclass(frozen=True, slots=True)
class Clocks:
    """The session clocks of a run (seconds), tokend's settings of the same names.

    expire_after is longer than the held-live window (heartbeat_interval + 15 s,
    tokend.core.lifecycle.HELD_LIVE_SLACK_MS): a client that missed a WELCOME (its resume
    went through, the WELCOME was lost with its link) shows a stale resume proof and is
    refused 4509 until that window has passed; with a shorter expire_after its session
    expires meanwhile (docs/security.md, "Random faults and the promises").
    """

    heartbeat_interval: float = 2.0
    warn_after: float = 6.0
    expire_after: float = 25.0
    redis_timeout: float = 1.0


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault or client action.

    ``node`` is the node it strikes (None: Redis, or no node); ``session`` the index of
    the session a client action is about; ``duration`` how long the fault lasts;
    ``amount`` a delay in seconds; ``via`` how a revocation is asked ("cli" or "admin").
    """

    at: float
    kind: str
    node: int | None = None
    session: int | None = None
    duration: float = 0.0
    amount: float = 0.0
    via: str = ""

    def as_json(self) -> dict[str, Any]:
        unset = {"node": None, "session": None, "duration": 0.0, "amount": 0.0, "via": ""}
        return {k: v for k, v in asdict(self).items() if k not in unset or v != unset[k]}


def schedule(
    seed: int, duration: float, sessions: int, clocks: Clocks, nodes: int = NODES
) -> list[Fault]:
    """The faults and actions of a run of ``duration`` seconds over ``sessions`` sessions,
    ordered by time; the last ``expire_after`` plus a margin stays calm so that every
    session's story ends inside the run.

    Node faults never overlap one another on the same node, and at most one node is down
    (killed or paused) at a time: the others can always serve. Redis failovers are at
    least 25 s apart (Sentinel's failover-timeout in the run is 10 s). Each session is
    the subject of at most one client action.
    """
    rng = random.Random(seed)
    calm_tail = clocks.expire_after + 5.0
    end = max(0.0, duration - calm_tail)
    faults: list[Fault] = []
    busy_until = [0.0] * nodes  # per node: the end of its last fault
    down_until = 0.0  # the end of the last kill or pause (any node)
    failover_after = 8.0
    at = 2.0
    while True:
        at += rng.expovariate(1 / 3.0)  # a fault every 3 s on average
        if at >= end:
            break
        kind = rng.choice((*NODE_FAULTS, NODE_RELOAD, REDIS_FAILOVER, *LINK_FAULTS))
        if kind == REDIS_FAILOVER:
            if at < failover_after:
                continue
            failover_after = at + 25.0
            faults.append(Fault(at, kind, duration=rng.uniform(3.0, 6.0)))
            continue
        if kind == NODE_RELOAD:
            node = RELOADING_NODE
        elif kind in (NODE_KILL, NODE_PAUSE):
            node = rng.randrange(1, nodes)
        else:
            node = rng.randrange(nodes)
        if busy_until[node] > at or (kind in (NODE_KILL, NODE_PAUSE) and down_until > at):
            continue
        lasting = {
            NODE_KILL: (1.0, 4.0),
            NODE_PAUSE: (clocks.warn_after + 0.5, clocks.warn_after + 3.0),
            NODE_RELOAD: (0.0, 0.0),
            NODE_REDIS_CUT: (0.5, clocks.expire_after + 2.0),
            NODE_REDIS_DELAY: (2.0, 8.0),
            CLIENT_CUT: (1.0, 4.0),
            CLIENT_DROP: (0.0, 0.0),
            CLIENT_DELAY: (2.0, 6.0),
        }[kind]
        length = round(rng.uniform(*lasting), 3)
        amount = round(rng.uniform(0.1, 1.5), 3) if kind in (NODE_REDIS_DELAY, CLIENT_DELAY) else 0
        # A reload takes its time; a dropped link is judged dead by warn_after.
        busy_until[node] = at + max(length, clocks.warn_after) + 2.0
        if kind in (NODE_KILL, NODE_PAUSE):
            down_until = busy_until[node]
        faults.append(Fault(round(at, 3), kind, node=node, duration=length, amount=amount))
    # Client actions, each on a session of its own (never one a takeover or revocation
    # already touched), spread over the fault phase.
    actions = max(4, sessions // 50)
    chosen = rng.sample(range(sessions), min(actions, sessions))
    for n, session in enumerate(chosen):
        kind = SESSION_ACTIONS[n % len(SESSION_ACTIONS)]
        via = rng.choice(("cli", "admin")) if kind == REVOKE else ""
        when = round(rng.uniform(3.0, max(3.5, end)), 3)
        faults.append(Fault(when, kind, session=session, via=via))
    faults.sort(key=lambda f: (f.at, f.kind))
    return faults


def planted_schedule(seed: int, sessions: int, clocks: Clocks) -> list[Fault]:
    """A short schedule (40 s) under which each planted defect (testkit/planted.py) shows:
    revocations by both ways, a failover after them (each revoked token is then tried
    again), logouts and silences, and takeovers of sessions held on node 1 while node 1 is
    cut from Redis (the takeover's close never reaches the old connection: only the
    heartbeat script's check of the connection ends it), then a node killed."""
    rng = random.Random(seed)
    chosen = iter(rng.sample(range(sessions), 8))
    faults = [
        Fault(2.0 + n / 4, REVOKE, session=next(chosen), via=("cli", "admin")[n % 2])
        for n in range(4)
    ]
    faults.append(Fault(5.0, REDIS_FAILOVER, duration=3.0))
    faults += [
        Fault(6.0, kind, session=next(chosen)) for kind in (LOGOUT, LOGOUT, SILENCE, SILENCE)
    ]
    faults.append(Fault(14.0, NODE_REDIS_CUT, node=1, duration=6.0))
    # `session` of a takeover with a node: the n-th session (by index) held on that node.
    faults += [Fault(15.0 + n / 4, TAKEOVER, node=1, session=n) for n in range(6)]
    faults.append(Fault(24.0, NODE_KILL, node=2, duration=2.0))
    return faults
