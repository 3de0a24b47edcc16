"""What a fault run saw: each client's records and the faults as applied (load_tests/faults.py
writes them, testkit/fault_checker.py judges them). Plain data, JSON in and out."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Record kinds, as the clients saw them (``client`` 0 is the session's own client, 1 the
# one that takes it over, 2 one that tries the token again after its revocation).
WELCOME = "welcome"  # node, resumed, exp
HEARTBEAT = "hb"  # seq: sent
ACK = "ack"  # seq, exp, token (when the ACK carried one), token_ok
CLOSE = "close"  # code (None: the connection was lost without a close frame)
REFUSED = "refused"  # no connection: code the HTTP status, None when none could be opened
REVOKED = "revoked"  # an operator's revocation, confirmed (t: when the confirmation came)
UNCONFIRMED = "unconfirmed"  # an operator's revocation the replicas did not confirm
SILENCE = "silence"  # the client went silent for good
LOGOUT = "logout"  # the client said BYE
TAKEOVER = "takeover"  # a second client is about to resume the session with its proof


@dataclass(slots=True)
class Record:
    """One thing a client saw or did, at wall-clock time ``t`` (seconds, as Redis's
    event times are in ms), on its connection number ``conn``."""

    t: float
    tid: str
    kind: str
    client: int = 0
    conn: int = 0
    node: int | None = None
    seq: int | None = None
    exp: int | None = None
    code: int | None = None
    token: str | None = None
    resumed: bool | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "token"}


@dataclass(frozen=True, slots=True)
class Window:
    """A fault as applied: ``kind`` on ``node`` (None: Redis, or every node) from ``start``
    to ``end`` (wall-clock seconds); ``amount`` a delay in seconds."""

    kind: str
    start: float
    end: float
    node: int | None = None
    amount: float = 0.0

    def covers(self, t: float, slack: float = 0.0) -> bool:
        return self.start <= t <= self.end + slack

    def name(self) -> str:
        where = "redis" if self.node is None else f"node {self.node}"
        return f"{self.kind} on {where} [{self.start:.3f}, {self.end:.3f}]"


@dataclass(slots=True)
class History:
    """A run's records, its applied faults, the durable stream's events (each
    ``{"id", "stream", "event"}``) and what a consumer group was delivered (the same)."""

    records: list[Record] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    stream: list[dict[str, Any]] = field(default_factory=list)
    group: list[dict[str, Any]] = field(default_factory=list)


def as_json(history: History) -> dict[str, Any]:
    return {
        "records": [r.as_json() for r in history.records],
        "windows": [asdict(w) for w in history.windows],
        "stream": history.stream,
        "group": history.group,
    }
