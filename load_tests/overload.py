"""Overload by priority: drive one tokend worker past what it can answer, and watch it shed.

Starts ``tokend serve`` (one worker, defaults: 30 s heartbeats, ``max_frame_rate`` 5,
``shed_lag``) on the embedded Redis and holds sessions of three ``prio`` levels, each
group in load-generator processes of its own (``bench.loadgen``):

* ``high`` (prio 9): heartbeats at the cadence throughout; must keep every heartbeat
  ACKed, with p99 at most 4x its unloaded p99, and never be refused;
* ``mid`` (prio 5) and ``low`` (prio 0): at the cadence throughout, resuming with the
  SDK's backoff what is shed: clients that keep their cadence, whose sessions must not
  expire;
* ``mid-flood`` and ``low-flood``: at the cadence, then flood (a heartbeat every
  ``--flood`` seconds, within the frame-rate limit) for ``--overload-for`` seconds;
  the node leaves what it sheds unanswered and must close none of them;
* ``warn`` (prio 5): silent until its sessions are in WARN, then floods too, from a few
  seconds into the overload: a WARN session must be shed before an ACTIVE one.

The flood is built before it begins (``bench.loadgen.Flood``: every heartbeat signed,
framed and masked, ``--flood-per-write`` to a write), so that it tests the server, not
its generator: the generator's processes must spend at most a quarter of the CPU
seconds tokend spends meanwhile (both read from /proc over the overload);
* ``storm-mid`` and ``storm-low``: new sessions all connecting as the overload begins
  (a connect storm), retrying refusals with the SDK's backoff, each heartbeating at
  the cadence from its WELCOME.

Every client retries as the SDK does (``bench.loadgen`` drives the SDK's ``Backoff``):
jittered exponential backoff after a 1013 or a lost connection, and after an HTTP 503
never sooner than its ``Retry-After`` (the node's shed penalty answers a client shed a
moment ago with the seconds it has left, ``shed_penalty``), so the figures are those
of real clients, not of a retry loop.

Phases: a baseline (every group but ``warn`` at the cadence, long enough for ``warn``
to reach WARN) gives the unloaded p99. In it each group's heartbeats move to an even
spread over the interval, as real clients' are: a group opened in a few seconds would
otherwise heartbeat in those few seconds of every interval, and its p99 would tell
whether that moment met the overload's onset, not how the node serves it throughout.
Then the overload; then a recovery in which every client heartbeats at the cadence and
resumes what was shed. Reported per group: heartbeats sent and ACKed, ACK p50/p99/max
(and by 5 s), refusals (1013 closes, HTTP 503 at the handshake), when the first 1013
came; the node's shedding steps (from its log); CPU and how long each process waited
for one (a tail the scheduler makes is not the node's), and tokend's by 5 s;
TOKEN_EXPIRED (must be 0: no client that kept its cadence loses its session). Last,
the done criterion: the best group's p99 against its unloaded p99 (goal at most 4x),
flooding clients closed after the flood began (goal 0), and the generator's CPU against
tokend's (goal at most 25 %), in the report and in ``--json`` (``done``).

With ``--pin`` tokend gets a CPU of its own (Redis and the clients the others), as in
the benches: the figures then tell what the node does with a core, not what it does
with the share of two cores its own load generators leave it.

    python load_tests/overload.py                      # 14,000 sessions, ~5 minutes
    python load_tests/overload.py --sessions 300 --heartbeat 3 --overload-for 4 --recovery 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from redis import asyncio as aioredis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: testkit/, bench/, load_tests/

from bench.common import (  # noqa: E402
    KEY_PREFIX,
    QUICK,
    ClientPool,
    Context,
    client_pool,
    open_all,
    split,
    tokend_server,
)
from load_tests import common  # noqa: E402
from testkit.events import read_events  # noqa: E402
from testkit.procs import CpuMeter, WaitMeter, proc_sched  # noqa: E402

P99_GOAL_RATIO = 4.0
# The most CPU the flood may cost its generator, as a share of what it costs tokend: a
# flood that costs its sender as much as the node measures the sender.
GENERATOR_SHARE_GOAL = 0.25
# Heartbeat intervals into the overload at which the WARN group starts flooding (5 s at
# the default cadence): by then the node sheds, so their first heartbeat meets it (a
# heartbeat stored first would recover them).
WARN_DELAY = 1 / 6
SHED_LINE = "overloaded: shedding sessions"


@dataclass(frozen=True)
class Group:
    name: str
    prio: int
    share: float  # of --sessions


GROUPS = (
    Group("high", 9, 0.2),
    Group("mid", 5, 0.15),
    Group("low", 0, 0.15),
    Group("mid-flood", 5, 0.15),
    Group("low-flood", 0, 0.15),
    Group("warn", 5, 1 / 12),
    Group("storm-mid", 5, 7 / 120),
    Group("storm-low", 0, 7 / 120),
)
HELD = ("high", "mid", "low", "mid-flood", "low-flood", "warn")
AT_CADENCE = ("mid", "low")  # through the overload, resuming what is shed
FLOODING = ("mid-flood", "low-flood")
# Groups that do not keep the cadence (they flood, or stay silent until WARN): their
# sessions may expire; every other group's must not.
MAY_EXPIRE = (*FLOODING, "warn")
FLOODERS = MAY_EXPIRE  # the groups whose load generators flood


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=14_000, help="all groups together")
    parser.add_argument(
        "--heartbeat", type=float, default=30.0, help="heartbeat interval, s (default 30)"
    )
    parser.add_argument(
        "--flood", type=float, default=0.25, help="s between a flooding session's heartbeats"
    )
    parser.add_argument(
        "--flood-per-write",
        type=int,
        # What the flood costs its generator is a write and a read of ACKs per write, not
        # per heartbeat: eight (two seconds of a 0.25 s flood) keep that under a quarter of what
        # the heartbeats cost tokend (GENERATOR_SHARE_GOAL).
        default=8,
        help="flood heartbeats per write (built before the flood: the generator does no work "
        "per heartbeat; default 8, within max_frame_rate's burst)",
    )
    parser.add_argument("--overload-for", type=float, default=60.0, help="s (default 60)")
    parser.add_argument("--recovery", type=float, default=100.0, help="s (default 100)")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="tokend on a CPU of its own, Redis and the clients on the others (as the benches "
        "run): what the node does when it is not sharing its core",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (logs) instead of removing it"
    )
    return parser.parse_args(argv)


@contextlib.asynccontextmanager
async def pools(
    ctx: Context, url: str, sizes: dict[str, int]
) -> AsyncIterator[tuple[dict[str, ClientPool], dict[str, set[str]]]]:
    """One client pool per group, each process from its own loopback address; the
    tids of each group."""
    taken: Counter[int] = Counter()  # tokens of each prio handed out so far
    tids: dict[str, set[str]] = {}
    addresses = iter(common.sources(64))
    async with contextlib.AsyncExitStack() as stack:
        made: dict[str, ClientPool] = {}
        for group in GROUPS:
            count = sizes[group.name]
            procs = len(split(count, -(-count // 5000)))
            tokens = ctx.tokens(
                sum(sizes[g.name] for g in GROUPS if g.prio == group.prio), prio=group.prio
            )
            first = taken[group.prio]
            tids[group.name] = {str(t) for t in tokens.tids[first : first + count]}
            made[group.name] = await stack.enter_async_context(
                client_pool(
                    ctx,
                    group.name,
                    url=url,
                    proto="tokend",
                    total=count,
                    procs=procs,
                    tokens=tokens,
                    first=first,
                    sources=[next(addresses) for _ in range(procs)],
                )
            )
            taken[group.prio] += count
        yield made, tids


def soak_args(args: argparse.Namespace, duration: float, **extra: Any) -> dict[str, Any]:
    return {"timeout": duration + 60, "interval": args.heartbeat, "duration": duration, **extra}


async def storm(args: argparse.Namespace, pool: ClientPool) -> list[dict[str, Any]]:
    """Connect every session of the pool as the overload begins (retrying refusals with
    the SDK's backoff); each heartbeats at the cadence from its WELCOME."""
    whole = args.overload_for + args.recovery
    return await pool.ask("soak", **soak_args(args, whole, reconnect=True, connect=True))


def group_figures(replies: Sequence[dict[str, Any]], since: float) -> dict[str, Any]:
    first = [r["first_close"].get("1013") for r in replies if r["first_close"].get("1013")]
    return {
        **common.heartbeat_figures(replies),
        "refusals": common.merged(replies, "refusals"),
        "first_1013_s": round(min(first) - since, 2) if first else None,
        "resumed": sum(sum(r["resumed_at"].values()) for r in replies),
        "live_at_end": sum(r["live"] for r in replies),
        "started_anew": sum(r["started_anew"] for r in replies),
        "timeline": common.timeline(replies, since),
    }


async def node_timeline(pid: int, since: float, until: float) -> list[dict[str, float]]:
    """tokend's main thread in buckets of ``common.TIMELINE_BUCKET_S`` seconds from
    ``since`` (wall-clock) to ``until``: the percentage of each on a CPU and waiting for
    one; the rest it slept, idle. A node that waits half its time has half a core."""
    bucket = common.TIMELINE_BUCKET_S
    rows: list[dict[str, float]] = []
    at, (on_cpu, waited) = time.time(), proc_sched(pid)
    while at < until:
        await asyncio.sleep(since + bucket * (len(rows) + 1) - time.time())
        now, (on_cpu_now, waited_now) = time.time(), proc_sched(pid)
        rows.append(
            {
                "t": bucket * len(rows),
                "on_cpu_pct": round(100 * (on_cpu_now - on_cpu) / (now - at)),
                "waited_pct": round(100 * (waited_now - waited) / (now - at)),
            }
        )
        at, on_cpu, waited = now, on_cpu_now, waited_now
    return rows


def shedding_steps(log: Path, since: float) -> list[str]:
    """The node's shedding steps, from its JSON log: "+<s> <what>"."""
    steps = []
    for line in log.read_text(errors="replace").splitlines():
        if SHED_LINE in line or "shedding fewer" in line or "shedding ended" in line:
            entry = json.loads(line)
            at = datetime.fromisoformat(entry["timestamp"]).timestamp()
            what = entry.get("shed", "")
            if "unanswered_heartbeats" in entry:  # shedding ended: what it left unanswered
                what = f"{entry['unanswered_heartbeats']:,} heartbeats left unanswered"
            steps.append(f"+{at - since:.1f} s {entry['event']}: {what}")
    return steps


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    ctx = Context(QUICK, workdir, "info", pin=args.pin)
    sizes = {g.name: max(1, round(args.sessions * g.share)) for g in GROUPS}
    clocks = {
        "heartbeat_interval": args.heartbeat,
        "warn_after": 3 * args.heartbeat,
        "expire_after": 4 * args.heartbeat,
    }
    baseline_s = clocks["warn_after"] + args.heartbeat / 3  # the warn group reaches WARN
    warn_delay = WARN_DELAY * args.heartbeat
    figures: dict[str, Any] = {"sizes": sizes}
    with tokend_server(ctx, "", **clocks) as server:
        redis: aioredis.Redis = common.pool_redis(server)
        began_ms = int(time.time() * 1000)
        async with pools(ctx, server.url, sizes) as (groups, tids):
            for name in HELD:
                # Each group heartbeats from its WELCOMEs while the next ones open (the
                # groups open one after another, for longer than warn_after on a slow
                # day); the warn group stays silent, to reach WARN.
                cadence = 0.0 if name == "warn" else args.heartbeat
                opened = await open_all(
                    groups[name], 50, retry_for=args.heartbeat, heartbeat=cadence
                )
                figures[f"open-{name}"] = opened["opened"]
            soaking = [n for n in HELD if n != "warn"]
            baseline = await asyncio.gather(
                *(
                    groups[n].ask("soak", **soak_args(args, baseline_s, spread=True))
                    for n in soaking
                )
            )
            figures["baseline"] = {
                n: common.heartbeat_figures(r) for n, r in zip(soaking, baseline, strict=True)
            }
            # The flood is built now, before it is measured (its cost: figures["flood_built"]).
            built = await asyncio.gather(
                *(
                    groups[n].ask(
                        "prepare_flood",
                        timeout=120,
                        every=args.flood,
                        seconds=args.overload_for - (warn_delay if n == "warn" else 0.0),
                        per_write=args.flood_per_write,
                    )
                    for n in FLOODERS
                )
            )
            figures["flood_built"] = {
                "frames": sum(r["frames"] for replies in built for r in replies),
                "cpu_s": round(sum(r["cpu_s"] for replies in built for r in replies), 2),
            }
            roles = {"tokend": server.pid, **{f"{n}": groups[n].pids[0] for n in groups}}
            cpu = CpuMeter(roles)
            cpu.start()
            waits = WaitMeter(roles.values())
            start = time.time()
            whole = args.overload_for + args.recovery
            node = asyncio.ensure_future(node_timeline(server.pid, start, start + whole))
            flood = {
                "reconnect": True,
                "flood": args.flood,
                "flood_per_write": args.flood_per_write,
            }
            high = asyncio.ensure_future(
                groups["high"].ask("soak", **soak_args(args, args.overload_for))
            )
            floods = {
                n: asyncio.ensure_future(
                    groups[n].ask(
                        "soak", **soak_args(args, whole, flood_for=args.overload_for, **flood)
                    )
                )
                for n in FLOODING
            } | {
                n: asyncio.ensure_future(
                    groups[n].ask("soak", **soak_args(args, whole, reconnect=True))
                )
                for n in AT_CADENCE
            }
            storms = {
                n: asyncio.ensure_future(storm(args, groups[n])) for n in ("storm-mid", "storm-low")
            }
            await asyncio.sleep(warn_delay)
            floods["warn"] = asyncio.ensure_future(
                groups["warn"].ask(
                    "soak",
                    **soak_args(
                        args,
                        whole - warn_delay,
                        flood_for=args.overload_for - warn_delay,
                        **flood,
                    ),
                )
            )
            high_overload = await high
            figures["cpu_pct_overload"] = cpu.stop()
            figures["cpu_window_s"] = round(time.time() - start, 1)
            figures["cpu_wait_pct_overload"] = waits.shares(roles)
            high_recovery = await groups["high"].ask(
                "soak", **soak_args(args, args.recovery, reconnect=True)
            )
            flooded = {n: await task for n, task in floods.items()}
            stormed = {n: await task for n, task in storms.items()}
            figures["node_timeline"] = await node
        events = await read_events(redis, KEY_PREFIX, began_ms)
        await redis.aclose()
        figures["shedding"] = shedding_steps(server.log, start)
    figures["overload"] = {"high": group_figures(high_overload, start)}
    figures["recovery"] = {"high": group_figures(high_recovery, start)}
    for name, replies in flooded.items():
        figures["overload"][name] = group_figures(replies, start)
    for name, replies in stormed.items():
        figures["overload"][name] = {
            "opened": sum(r["started_anew"] for r in replies),
            **group_figures(replies, start),
        }
    figures["events"] = {
        name: dict(Counter(e["type"] for e in events if e["tid"] in group))
        for name, group in tids.items()
    }
    figures["overload_s"], figures["baseline_s"] = args.overload_for, baseline_s
    figures["flood_s"] = args.flood
    figures["done"] = done(figures)
    return figures


def done(figures: dict[str, Any]) -> dict[str, Any]:
    """The run's done criterion: the best group's p99 against its own unloaded p99, the
    flooding clients closed after the flood began, and what the flood cost its generator
    (CPU seconds from /proc, its processes) against what it cost tokend."""
    base = figures["baseline"]["high"]["ack_latency"]["p99_ms"]
    loaded = figures["overload"]["high"]["ack_latency"]["p99_ms"]
    cpu, window = figures["cpu_pct_overload"], figures["cpu_window_s"]
    generator_s = sum(cpu[name] for name in FLOODERS) * window / 100
    tokend_s = cpu["tokend"] * window / 100
    return {
        "high_p99_ms": loaded,
        "high_p99_unloaded_ms": base,
        "high_p99_ratio": round(loaded / base, 2) if base else None,
        "flood_closed": sum(sum(figures["overload"][n]["closes"].values()) for n in FLOODERS),
        "generator_cpu_s": round(generator_s, 1),
        "tokend_cpu_s": round(tokend_s, 1),
        "generator_share": round(generator_s / tokend_s, 3) if tokend_s else None,
    }


def verdict(figures: dict[str, Any]) -> list[str]:
    problems = []
    base = figures["baseline"]["high"]["ack_latency"]["p99_ms"]
    high = figures["overload"]["high"]
    for window in ("baseline", "overload", "recovery"):
        h = figures[window]["high"]
        if h["acks"] != h["sent"] or h["closes"] or h.get("refusals"):
            unacked = h["sent"] - h["acks"]
            problems.append(f"high, {window}: {unacked} unACKed, {h['closes']} {h.get('refusals')}")
    if high["ack_latency"]["p99_ms"] > P99_GOAL_RATIO * base:
        problems.append(
            f"high p99 {high['ack_latency']['p99_ms']:.2f} ms > {P99_GOAL_RATIO}x {base:.2f} ms"
        )
    met = figures["done"]
    if met["flood_closed"]:
        problems.append(f"{met['flood_closed']} flood clients closed after the flood began")
    if met["generator_share"] is None or met["generator_share"] > GENERATOR_SHARE_GOAL:
        problems.append(
            f"the flood cost its generator {met['generator_share']} of tokend's CPU "
            f"> {GENERATOR_SHARE_GOAL}"
        )
    for name, events in figures["events"].items():
        if name not in MAY_EXPIRE and events.get("TOKEN_EXPIRED"):
            problems.append(f"{name}: {events['TOKEN_EXPIRED']} TOKEN_EXPIRED")
    return problems


def row(window: str, name: str, g: dict[str, Any]) -> str:
    return (
        f"{window:11} {name:9} {g['sent']:>8,} sent {g['acks']:>8,} ACKed  "
        + common.latency_line(g["ack_latency"], g["client_loop_lag"])
    )


def report(figures: dict[str, Any], problems: list[str]) -> str:
    lines = [f"groups:     {figures['sizes']}"]
    lines += [row("baseline", name, g) for name, g in figures["baseline"].items()]
    for name, g in figures["overload"].items():
        refusals = g["refusals"]
        lines += [
            row("overload", name, g),
            f"{'':21} closes {g['closes'] or '-'}; refusals {refusals or '-'}; first 1013 at "
            f"+{g['first_1013_s']} s; resumed {g['resumed']}, live at end {g['live_at_end']}, "
            f"new sessions {g['started_anew']}",
        ]
    lines.append(row("recovery", "high", figures["recovery"]["high"]))
    lines.append(
        "by 5 s from the overload's start (ACKs / > 250 ms / slowest ms / client loop lag ms):"
    )
    lines += [
        f"{'':11} {name:9} "
        + "; ".join(
            f"{r['t']:+d} {r['acks']}/{r['slow']}/{r['max_ms']:g}/{r['client_lag_ms']:g}"
            for r in figures["overload"][name]["timeline"]
        )
        for name in ("high", *AT_CADENCE)
    ]
    lines.append(
        f"{'':11} {'tokend':9} "
        + "; ".join(
            f"{r['t']:+d} {r['on_cpu_pct']}/{r['waited_pct']}" for r in figures["node_timeline"]
        )
        + " (% of each on a CPU / waiting for one)"
    )
    lines.append(f"CPU during the overload (% of a core): {figures['cpu_pct_overload']}")
    built = figures["flood_built"]
    lines.append(
        f"flood built before the overload: {built['frames']:,} frames in {built['cpu_s']} CPU s"
    )
    lines.append(
        "waited for a CPU during the overload (% of it; tokend's own process, the first of "
        f"each group's): {figures['cpu_wait_pct_overload']}"
    )
    lines.append("shedding:   " + ("\n            ".join(figures["shedding"]) or "none"))
    lines += [f"events:     {name:9} {events}" for name, events in figures["events"].items()]
    met = figures["done"]
    share = met["generator_share"]
    lines += [
        f"done:       high p99 {met['high_p99_ms']:.2f} ms vs unloaded "
        f"{met['high_p99_unloaded_ms']:.2f} ms = {met['high_p99_ratio']}x "
        f"(goal <= {P99_GOAL_RATIO:g}x)",
        f"{'':12}flood clients closed after the flood began: {met['flood_closed']} (goal 0)",
        f"{'':12}generator CPU / tokend CPU: {met['generator_cpu_s']} s / "
        f"{met['tokend_cpu_s']} s = {100 * share if share is not None else float('nan'):.1f} %"
        f" (goal <= {100 * GENERATOR_SHARE_GOAL:g} %)",
    ]
    lines.append(f"result:     {'FAIL: ' + '; '.join(problems) if problems else 'PASS'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    began = time.monotonic()
    with common.scratch("tokend-overload-", keep=args.keep) as workdir:
        figures = asyncio.run(run(args, workdir))
    figures |= {"wall_s": round(time.monotonic() - began, 1), "workdir": str(workdir)}
    problems = verdict(figures)
    return common.finish(figures, problems, report(figures, problems), args.json)


if __name__ == "__main__":
    sys.exit(main())
