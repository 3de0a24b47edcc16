"""The checker of a fault run: a :class:`~testkit.fault_history.History` in, violations out.

Pure: no I/O, no clock; a token is checked by the ``verify`` function given (the run's
keys). The promises, each a function below:

* **expired once**: at most one TOKEN_EXPIRED per session in the stream; exactly one for a
  session whose client went silent on purpose;
* **no wrongful expiry**: a session whose client kept its cadence (up to its own action, if
  any) never expires (TOKEN_EXPIRED, close 4505), and is never closed as revoked (4506)
  or taken over (4507) unless an operator revoked it or a second client took it over;
  except where the applied faults left the client no node to heartbeat for longer than
  the clocks (:func:`expiry_excuse`, each excuse naming its fault windows);
* **revocation never undone**: after a confirmed revocation no client of the token gets a
  WELCOME, nor an ACK for a heartbeat sent after the confirmation, unless that
  connection's node was off Redis then (it acknowledges from what it knows, and the
  revocation reaches it when Redis does: docs/protocol.md §6);
* **one connection at a time**: a connection gets no ACK for a heartbeat it sent after
  another connection of the session was welcomed later than it, unless the old one's
  node was off Redis then (it acknowledges from what it knows: docs/protocol.md §6);
* **exp forward**: the exp each client of a session is told (WELCOME, ACK) never goes back, and
  every token an ACK hands over verifies, for this session, with the ACK's exp;
* **events once**: no two stream entries alike; a consumer group is delivered each entry
  of the stream, and none twice outside a Redis failover.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from testkit import fault_history as h
from testkit import fault_schedule as fs
from tokend.core.protocol import CloseCode

# (tid, exp_ms) of a token that verifies at a time (s); None for one that does not.
Verify = Callable[[str, float], tuple[str, int] | None]
# Seconds around a fault window within which its effects still show: a Redis call's
# deadline, a sweep, an event's way back. Small next to the clocks.
SLACK = 2.0
ENDING_CODES = {
    CloseCode.SESSION_EXPIRED: "expired",
    CloseCode.TOKEN_REVOKED: "revoked",
    CloseCode.TAKEN_OVER: "taken over",
}


@dataclass(frozen=True, slots=True)
class Violation:
    promise: str
    tid: str
    detail: str


@dataclass(frozen=True, slots=True)
class Excuse:
    tid: str
    reason: str
    window: str  # the fault window that justifies it


@dataclass(slots=True)
class Verdict:
    violations: list[Violation] = field(default_factory=list)
    excused: list[Excuse] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)

    def excused_by_reason(self) -> dict[str, int]:
        return dict(Counter(e.reason for e in self.excused))


@dataclass(slots=True)
class Story:
    """One session: its records in time order, its events, and what its client meant."""

    tid: str
    records: list[h.Record] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def first(self, kind: str) -> h.Record | None:
        return next((r for r in self.records if r.kind == kind), None)

    @property
    def action_at(self) -> float | None:
        """When the session's deliberate end began (silence, logout, revocation, takeover)."""
        deliberate = [
            r.t
            for r in self.records
            if r.kind in (h.SILENCE, h.LOGOUT, h.REVOKED, h.UNCONFIRMED, h.TAKEOVER)
        ]
        return min(deliberate, default=None)

    def telling(self) -> str:
        lines = [f"session {self.tid}:"]
        entries = [(r.t, "client", r.as_json()) for r in self.records]
        entries += [(e["at"] / 1000, "event", e) for e in self.events]
        for t, source, what in sorted(entries, key=lambda x: x[0]):
            what = {k: v for k, v in what.items() if k not in ("t", "tid", "at", "v", "sub")}
            lines.append(f"  {t:.3f} {source} {what}")
        return "\n".join(lines)


def _excuse(excused: list[Excuse], excuse: Excuse) -> None:
    """Each session is reported once per reason and window."""
    if excuse not in excused:
        excused.append(excuse)


def stories(history: h.History) -> dict[str, Story]:
    by_tid: dict[str, Story] = {}
    for record in sorted(history.records, key=lambda r: r.t):
        by_tid.setdefault(record.tid, Story(record.tid)).records.append(record)
    for entry in history.stream:
        event = entry["event"]
        if event["tid"] in by_tid:
            by_tid[event["tid"]].events.append(event)
    return by_tid


def check(history: h.History, clocks: fs.Clocks, verify: Verify) -> Verdict:
    verdict = Verdict()
    for story in stories(history).values():
        verdict.outcomes[outcome(story)] += 1
        found = [
            *expired_once(story),
            *no_wrongful_end(story, history.windows, clocks, verdict.excused),
            *revocation_kept(story, history.windows, clocks, verdict.excused),
            *one_connection(story, history.windows, clocks, verdict.excused),
            *exp_forward(story, verify),
        ]
        verdict.violations += found
    verdict.violations += events_once(history)
    return verdict


def outcome(story: Story) -> str:
    """How the session's own client ended, or ``open`` at the end of the run."""
    if story.first(h.SILENCE):
        return "silent"
    if story.first(h.LOGOUT):
        return "logged_out"
    if story.first(h.REVOKED):
        return "revoked"
    closes = [r for r in story.records if r.kind == h.CLOSE and r.client == 0]
    code = closes[-1].code if closes else None
    if code in ENDING_CODES and closes[-1] is story.records[-1]:
        return ENDING_CODES[CloseCode(code)].replace(" ", "_")
    return "taken_over" if story.first(h.TAKEOVER) else "open"


def expired_once(story: Story) -> Iterable[Violation]:
    expired = [e for e in story.events if e["type"] == "TOKEN_EXPIRED"]
    if len(expired) > 1:
        yield Violation("expired once", story.tid, f"{len(expired)} TOKEN_EXPIRED")
    if story.first(h.SILENCE) and story.first(h.WELCOME) and not expired:
        yield Violation("expired once", story.tid, "silent on purpose, never expired")


def no_wrongful_end(
    story: Story, windows: list[h.Window], clocks: fs.Clocks, excused: list[Excuse]
) -> Iterable[Violation]:
    """No expiry, revocation or takeover the session's own client did not bring on."""
    deliberate = story.action_at
    expiries = [e["at"] / 1000 for e in story.events if e["type"] == "TOKEN_EXPIRED"]
    ends = [(t, "TOKEN_EXPIRED event", True) for t in expiries]
    for r in story.records:
        if r.kind != h.CLOSE or r.client != 0 or r.code not in ENDING_CODES:
            continue
        if r.code == CloseCode.SESSION_EXPIRED and any(t <= r.t for t in expiries):
            continue  # the client told of an expiry in the stream: judged by the event's time
        what = f"closed {r.code} ({ENDING_CODES[CloseCode(r.code)]})"
        ends.append((r.t, what, r.code == CloseCode.SESSION_EXPIRED))
    for t, what, expiry in ends:
        if deliberate is not None and t >= deliberate - SLACK:
            continue
        excuse = expiry_excuse(story, t, windows, clocks) if expiry else None
        if excuse is not None:
            _excuse(excused, Excuse(story.tid, excuse[0], excuse[1].name()))
            continue
        yield Violation(
            "no wrongful expiry", story.tid, f"{what} at {t:.3f}, client kept its cadence"
        )


def off_redis(window: h.Window, clocks: fs.Clocks) -> bool:
    """A window in which its node could not reach Redis in time."""
    return window.kind == fs.NODE_REDIS_CUT or (
        window.kind == fs.NODE_REDIS_DELAY and window.amount >= clocks.redis_timeout / 2
    )


def unserving(window: h.Window, clocks: fs.Clocks) -> bool:
    """A window in which its node served no client of the session's (or none in time)."""
    return off_redis(window, clocks) or window.kind in (
        fs.NODE_KILL,
        fs.NODE_PAUSE,
        fs.CLIENT_CUT,
    )


def expiry_excuse(
    story: Story, t: float, windows: list[h.Window], clocks: fs.Clocks
) -> tuple[str, h.Window] | None:
    """The fault windows that explain an expiry at ``t`` of a cadence-keeping session:
    ``no_node``, from at least expire_after less warn_after before the expiry, every node
    was killed, paused, cut from the clients or off Redis, each by a window of its own:
    the client had nowhere to heartbeat. (A node off Redis alone excuses nothing: it
    sends its clients to resume elsewhere, settings.off_redis.)"""
    since = t - clocks.expire_after + clocks.warn_after
    covering: dict[int, h.Window] = {}
    for window in windows:
        lasting = window.start <= since and window.end >= t - SLACK
        if window.node is not None and unserving(window, clocks) and lasting:
            covering.setdefault(window.node, window)
    if len(covering) == fs.NODES:
        return "no_node", min(covering.values(), key=lambda w: w.end)
    return None


def acked_off_redis(
    story: Story,
    welcome: h.Record,
    beat: float,
    windows: list[h.Window],
    clocks: fs.Clocks,
    excused: list[Excuse],
) -> bool:
    """Whether the node of the connection ``welcome`` opened was off Redis when the
    heartbeat sent at ``beat`` reached it: it acknowledged from what it knew, and neither
    a takeover nor a revocation could reach it meanwhile (docs/protocol.md §6). Recorded
    as an excuse when so."""
    window = next(
        (
            w
            for w in windows
            if w.node == welcome.node and off_redis(w, clocks) and w.covers(beat, SLACK)
        ),
        None,
    )
    if window is not None:
        _excuse(excused, Excuse(story.tid, "acked_off_redis", window.name()))
    return window is not None


def revocation_kept(
    story: Story, windows: list[h.Window], clocks: fs.Clocks, excused: list[Excuse]
) -> Iterable[Violation]:
    """No WELCOME after the confirmation (a WELCOME needs Redis: never excused), and no
    ACK of a heartbeat sent after it, unless its node was off Redis then."""
    revoked = story.first(h.REVOKED)
    if revoked is None:
        return
    welcomed: dict[tuple[int, int], h.Record] = {}
    sent: dict[tuple[int, int, int], float] = {}
    for r in story.records:
        if r.kind == h.WELCOME:
            welcomed[(r.client, r.conn)] = r
        if r.kind == h.HEARTBEAT and r.seq is not None:
            sent[(r.client, r.conn, r.seq)] = r.t
        if r.t <= revoked.t:
            continue
        if r.kind == h.WELCOME:
            yield Violation(
                "revocation never undone",
                story.tid,
                f"client {r.client} welcomed at {r.t:.3f}, after the revocation confirmed "
                f"at {revoked.t:.3f}",
            )
        if r.kind != h.ACK or r.seq is None:
            continue
        beat = sent.get((r.client, r.conn, r.seq), 0.0)
        if beat > revoked.t:
            welcome = welcomed.get((r.client, r.conn))
            if welcome is not None and acked_off_redis(
                story, welcome, beat, windows, clocks, excused
            ):
                continue
            yield Violation(
                "revocation never undone",
                story.tid,
                f"ACK of seq {r.seq} sent after the revocation confirmed at {revoked.t:.3f}",
            )


def one_connection(
    story: Story, windows: list[h.Window], clocks: fs.Clocks, excused: list[Excuse]
) -> Iterable[Violation]:
    welcomed: dict[tuple[int, int], h.Record] = {}
    sent: dict[tuple[int, int, int], float] = {}
    for r in story.records:
        key = (r.client, r.conn)
        if r.kind == h.WELCOME:
            welcomed[key] = r
        elif r.kind == h.HEARTBEAT and r.seq is not None:
            sent[(r.client, r.conn, r.seq)] = r.t
        elif r.kind == h.ACK and r.seq is not None and key in welcomed:
            mine = welcomed[key]
            beat = sent.get((r.client, r.conn, r.seq))
            if beat is None:
                continue
            later = [w for k, w in welcomed.items() if k != key and mine.t < w.t < beat]
            if not later:
                continue
            if acked_off_redis(story, mine, beat, windows, clocks, excused):
                continue
            yield Violation(
                "one connection at a time",
                story.tid,
                f"client {r.client} connection {r.conn} ACKed seq {r.seq} sent at {beat:.3f}, "
                f"after client {later[0].client} connection {later[0].conn} was welcomed at "
                f"{later[0].t:.3f}",
            )


def exp_forward(story: Story, verify: Verify) -> Iterable[Violation]:
    """Each client's view: a connection acknowledging from what its node knows (off Redis)
    may lag behind a renewal another client of the session got meanwhile."""
    highest: dict[int, int] = defaultdict(int)
    for r in story.records:
        if r.kind not in (h.WELCOME, h.ACK) or r.exp is None:
            continue
        if r.exp < highest[r.client]:
            yield Violation(
                "exp forward",
                story.tid,
                f"client {r.client} {r.kind} at {r.t:.3f} says exp {r.exp} "
                f"after {highest[r.client]}",
            )
        highest[r.client] = max(highest[r.client], r.exp)
        if r.kind == h.ACK and r.token is not None:
            claims = verify(r.token, r.t)
            if claims != (story.tid, r.exp):
                yield Violation(
                    "exp forward",
                    story.tid,
                    f"ACK at {r.t:.3f} hands a token that does not verify as "
                    f"({story.tid}, {r.exp}): {claims}",
                )


def events_once(history: h.History) -> Iterable[Violation]:
    payloads = Counter(_payload(entry) for entry in history.stream)
    tids = {_payload(entry): entry["event"]["tid"] for entry in history.stream}
    for payload, count in payloads.items():
        if count > 1:
            yield Violation(
                "events once", tids[payload], f"{count} stream entries alike: {payload}"
            )
    delivered: dict[str, list[float]] = defaultdict(list)
    for entry in history.group:
        delivered[entry["id"]].append(entry["event"]["at"] / 1000)
    failovers = [w for w in history.windows if w.kind == fs.REDIS_FAILOVER]
    for entry in history.stream:
        if entry["id"] not in delivered:
            yield Violation(
                "events once",
                entry["event"]["tid"],
                f"stream entry {entry['id']} never delivered to the group",
            )
    for entry_id, times in delivered.items():
        if len(times) > 1 and not any(w.covers(times[0], 30.0) for w in failovers):
            yield Violation(
                "events once", "", f"entry {entry_id} delivered {len(times)} times to the group"
            )


def _payload(entry: dict[str, Any]) -> str:
    return str(sorted(entry["event"].items()))
