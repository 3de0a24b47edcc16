"""The fault run (load_tests/faults.py): its schedule is a function of the seed, its checker
judges synthetic histories as the promises say, catches each defect planted in a copy of
tokend (and nothing in tokend as it is), and a short seeded run breaks no promise."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from testkit import fault_history as h
from testkit import fault_schedule as fs
from testkit.fault_checker import Verdict, check
from testkit.planted import DEFECTS, planted_copy

ROOT = Path(__file__).resolve().parent.parent
CLOCKS = fs.Clocks(heartbeat_interval=1.0, warn_after=3.0, expire_after=8.0, redis_timeout=1.0)
TID = "6f1c0000-0000-4000-8000-000000000001"
EXP = 1_000_000_000


# The schedule ------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    first = fs.schedule(42, 600, 2000, CLOCKS)
    assert first == fs.schedule(42, 600, 2000, CLOCKS)
    assert first != fs.schedule(43, 600, 2000, CLOCKS)
    assert fs.planted_schedule(5, 200, CLOCKS) == fs.planted_schedule(5, 200, CLOCKS)
    # As the summary shows it: node 0 and session 0 named, what is unset left out.
    cut = fs.Fault(1.0, fs.CLIENT_CUT, node=0, duration=2.0).as_json()
    assert cut == {"at": 1.0, "kind": fs.CLIENT_CUT, "node": 0, "duration": 2.0}


def test_the_schedule_keeps_a_node_serving_and_a_calm_end() -> None:
    faults = fs.schedule(7, 600, 2000, CLOCKS)
    kinds = {f.kind for f in faults}
    assert set(fs.KINDS) <= kinds
    end = 600 - CLOCKS.expire_after - 5
    assert all(f.at < end for f in faults)
    down = [f for f in faults if f.kind in (fs.NODE_KILL, fs.NODE_PAUSE)]
    for one, two in itertools.pairwise(down):
        assert two.at >= one.at + one.duration, "two nodes down at once"
    assert all(f.node != fs.RELOADING_NODE for f in down)
    failovers = [f.at for f in faults if f.kind == fs.REDIS_FAILOVER]
    assert all(b - a >= 25 for a, b in itertools.pairwise(failovers))
    acted = [f.session for f in faults if f.kind in fs.SESSION_ACTIONS]
    assert len(acted) == len(set(acted))


# The checker on synthetic histories --------------------------------------------------------


def verify(token: str, at: float) -> tuple[str, int] | None:
    """Tokens of these histories are "tid:exp"; "forged" never verifies."""
    if token == "forged":
        return None
    tid, exp = token.split(":")
    return tid, int(exp)


def kept(start: float = 100.0, beats: int = 5, node: int = 0, conn: int = 1) -> list[h.Record]:
    """A client that keeps its cadence: WELCOME, then each heartbeat ACKed."""
    records = [h.Record(start, TID, h.WELCOME, conn=conn, node=node, exp=EXP, resumed=False)]
    for seq in range(1, beats + 1):
        records.append(h.Record(start + seq, TID, h.HEARTBEAT, conn=conn, seq=seq))
        records.append(h.Record(start + seq + 0.01, TID, h.ACK, conn=conn, seq=seq, exp=EXP))
    return records


def event(kind: str, at: float, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "type": kind, "tid": TID, "sub": "u", "at": int(at * 1000), **fields}


def judged(
    records: list[h.Record],
    events: Sequence[dict[str, Any]] = (),
    windows: Sequence[h.Window] = (),
    group: list[dict[str, Any]] | None = None,
) -> Verdict:
    stream = [{"id": f"s/{n}-0", "event": e} for n, e in enumerate(events)]
    history = h.History(list(records), list(windows), stream, stream if group is None else group)
    return check(history, CLOCKS, verify)


def promises(verdict: Verdict) -> list[str]:
    return [v.promise for v in verdict.violations]


def test_a_client_that_kept_its_cadence_and_stayed_breaks_nothing() -> None:
    verdict = judged(kept(), [event("SESSION_STARTED", 100)])
    assert verdict.violations == [] and verdict.outcomes == {"open": 1}


def test_a_silent_client_expires_exactly_once() -> None:
    silent = [*kept(), h.Record(106, TID, h.SILENCE)]
    assert promises(judged(silent)) == ["expired once"]
    assert promises(judged(silent, [event("TOKEN_EXPIRED", 114)])) == []
    twice = [event("TOKEN_EXPIRED", 114), event("TOKEN_EXPIRED", 115)]
    assert promises(judged(silent, twice)) == ["expired once"]


def test_a_cadence_keeping_session_never_expires_nor_ends_unasked() -> None:
    assert promises(judged(kept(), [event("TOKEN_EXPIRED", 104)])) == ["no wrongful expiry"]
    closed = [*kept(), h.Record(105.5, TID, h.CLOSE, conn=1, code=4506)]
    assert promises(judged(closed)) == ["no wrongful expiry"]
    # Revoked by an operator first: its 4506 is no wrong.
    revoked = [
        *kept(),
        h.Record(105.2, TID, h.REVOKED),
        h.Record(105.5, TID, h.CLOSE, conn=1, code=4506),
    ]
    assert promises(judged(revoked)) == []


def test_an_expiry_under_its_nodes_long_cut_from_redis_is_not_excused() -> None:
    """A node cut from Redis alone sends its clients to resume elsewhere (off_redis
    leave): an expiry under it is a violation, told once with its 4505."""
    records = kept(start=100, beats=3, node=1)
    long_cut = h.Window(fs.NODE_REDIS_CUT, 103.5, 114.0, node=1)
    verdict = judged(records, [event("TOKEN_EXPIRED", 112)], [long_cut])
    assert promises(verdict) == ["no wrongful expiry"] and verdict.excused == []
    told = [*records, h.Record(116.5, TID, h.CLOSE, conn=1, code=4505)]
    verdict = judged(told, [event("TOKEN_EXPIRED", 112)], [long_cut])
    assert promises(verdict) == ["no wrongful expiry"]


def test_an_expiry_while_every_node_was_out_of_reach_is_excused() -> None:
    records = kept(start=100, beats=3, node=0)
    windows = [
        h.Window(fs.CLIENT_CUT, 103.0, 113.0, node=0),
        h.Window(fs.NODE_PAUSE, 102.0, 113.0, node=1),
        h.Window(fs.NODE_REDIS_CUT, 102.5, 112.5, node=2),
    ]
    verdict = judged(records, [event("TOKEN_EXPIRED", 112)], windows)
    assert verdict.violations == [] and verdict.excused_by_reason() == {"no_node": 1}
    assert promises(judged(records, [event("TOKEN_EXPIRED", 112)], windows[:2])) == [
        "no wrongful expiry"
    ]


def test_a_confirmed_revocation_is_never_undone() -> None:
    records = [*kept(), h.Record(106, TID, h.REVOKED)]
    assert promises(judged(records)) == []
    welcomed = h.Record(120, TID, h.WELCOME, client=2, conn=1, node=1, exp=EXP, resumed=True)
    assert promises(judged([*records, welcomed])) == ["revocation never undone"]
    late_beat = [
        h.Record(107, TID, h.HEARTBEAT, conn=1, seq=9),
        h.Record(107.1, TID, h.ACK, conn=1, seq=9, exp=EXP),
    ]
    assert promises(judged([*records, *late_beat])) == ["revocation never undone"]


def test_an_ack_after_a_revocation_is_excused_only_while_its_node_is_off_redis() -> None:
    records = [
        *kept(node=0),
        h.Record(106, TID, h.REVOKED),
        h.Record(107, TID, h.HEARTBEAT, conn=1, seq=9),
        h.Record(107.1, TID, h.ACK, conn=1, seq=9, exp=EXP),
    ]
    its_node_cut = h.Window(fs.NODE_REDIS_CUT, 105.0, 110.0, node=0)
    verdict = judged(records, windows=[its_node_cut])
    assert verdict.violations == [] and verdict.excused_by_reason() == {"acked_off_redis": 1}
    another_node_cut = h.Window(fs.NODE_REDIS_CUT, 105.0, 110.0, node=1)
    assert promises(judged(records, windows=[another_node_cut])) == ["revocation never undone"]
    # A WELCOME needs Redis: one after the revocation is never excused.
    welcomed = h.Record(108, TID, h.WELCOME, client=2, conn=1, node=0, exp=EXP, resumed=True)
    verdict = judged([*records, welcomed], windows=[its_node_cut])
    assert promises(verdict) == ["revocation never undone"]


def test_the_older_connection_gets_no_ack_after_a_takeover_unless_its_node_was_off_redis() -> None:
    records = [
        *kept(start=100, beats=3, node=1),
        h.Record(103.5, TID, h.TAKEOVER),
        h.Record(103.6, TID, h.WELCOME, client=1, conn=1, node=2, exp=EXP, resumed=True),
        h.Record(104, TID, h.HEARTBEAT, conn=1, seq=4),
        h.Record(104.01, TID, h.ACK, conn=1, seq=4, exp=EXP),
    ]
    assert promises(judged(records)) == ["one connection at a time"]
    cut = h.Window(fs.NODE_REDIS_CUT, 103.0, 105.0, node=1)
    verdict = judged(records, windows=[cut])
    assert verdict.violations == [] and verdict.excused_by_reason() == {"acked_off_redis": 1}


def test_exp_only_moves_forward_and_every_token_verifies() -> None:
    records = kept()
    records.append(h.Record(107, TID, h.ACK, conn=1, seq=6, exp=EXP - 1000))
    assert promises(judged(records)) == ["exp forward"]
    renewed = h.Record(107, TID, h.ACK, conn=1, seq=6, exp=EXP + 1000, token=f"{TID}:{EXP + 1000}")
    assert promises(judged([*kept(), renewed])) == []
    for token in ("forged", f"{TID}:{EXP}"):
        bad = h.Record(107, TID, h.ACK, conn=1, seq=6, exp=EXP + 1000, token=token)
        assert promises(judged([*kept(), bad])) == ["exp forward"]


def test_each_event_is_in_the_stream_once_and_delivered_to_the_group_once() -> None:
    started = event("SESSION_STARTED", 100)
    assert promises(judged(kept(), [started, dict(started)])) == ["events once"]
    stream_entry = {"id": "s/0-0", "event": started}
    assert promises(judged(kept(), [started], group=[])) == ["events once"]
    assert promises(judged(kept(), [started], group=[stream_entry, stream_entry])) == [
        "events once"
    ]
    failover = h.Window(fs.REDIS_FAILOVER, 99.0, 101.0)
    twice = judged(kept(), [started], [failover], group=[stream_entry, stream_entry])
    assert twice.violations == []


# Real runs ---------------------------------------------------------------------------------


class FaultsRun:
    """load_tests/faults.py started as a process of its own; :meth:`result` waits for its
    end and reads its JSON summary."""

    def __init__(self, folder: Path, *args: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.summary = folder / "faults.json"
        self.output = folder / "output.txt"
        with self.output.open("w") as output:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "load_tests" / "faults.py"),
                    "--json",
                    str(self.summary),
                    *args,
                ],
                stdout=output,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # faults.py stops what it started on SIGTERM
            self.process.wait(timeout=60)

    def result(self) -> dict[str, Any]:
        try:
            status = self.process.wait(timeout=RUN_TIMEOUT)
        finally:
            self.stop()
        told = self.output.read_text()[-3000:]
        assert self.summary.exists(), told
        result: dict[str, Any] = json.loads(self.summary.read_text())
        assert result["problems"] == [], result["problems"]
        assert (status == 0) == (result["violations"] == []), told
        return result


def test_each_defect_planted_applies_to_the_package_once(tmp_path: Path) -> None:
    for defect in DEFECTS:
        planted_copy(defect, tmp_path / defect)  # raises if an edit no longer applies


# Which promise each planted defect breaks.
CAUGHT_AS = {
    "resume_skips_revocation": "revocation never undone",
    "heartbeat_skips_cas": "one connection at a time",
    "event_twice": "events once",
}
PLANTED_RUN = ("--seed", "3", "--duration", "40", "--sessions", "200", "--planted-schedule")


# A run: its processes started, its sessions opened, its schedule and its calm end.
RUN_TIMEOUT = 600


@pytest.fixture(scope="module")
def planted_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str | None, FaultsRun]]:
    """The planted schedule's run without a defect and with each, started together: each
    run mostly waits on its clocks, and 200 sessions each leave the cores room for four."""
    folder = tmp_path_factory.mktemp("planted")
    runs: dict[str | None, FaultsRun] = {}
    try:
        for defect in [None, *CAUGHT_AS]:
            plant = () if defect is None else ("--plant", defect)
            runs[defect] = FaultsRun(folder / str(defect), *PLANTED_RUN, *plant)
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.mark.timeout(RUN_TIMEOUT)
@pytest.mark.parametrize("defect", [None, *CAUGHT_AS])
def test_the_checker_catches_each_planted_defect_and_nothing_without(
    planted_runs: dict[str | None, FaultsRun], defect: str | None
) -> None:
    result = planted_runs[defect].result()
    caught = {v["promise"] for v in result["violations"]}
    if defect is None:
        assert caught == set(), result["violations"][:3]
    else:  # a defect may break other promises too (twice the events: two expiries)
        assert CAUGHT_AS[defect] in caught, result["violations"][:3]


@pytest.mark.timeout(RUN_TIMEOUT)
def test_a_short_seeded_run_breaks_no_promise(tmp_path: Path) -> None:
    result = FaultsRun(tmp_path, "--seed", "11", "--duration", "60", "--sessions", "400").result()
    assert result["violations"] == []
    assert sum(result["faults_by_kind"].values()) >= 10
    assert result["sessions_by_outcome"].get("open", 0) > 200
