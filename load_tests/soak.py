"""Soak: hold as many tokend sessions as the open-file limit allows, heartbeating, for long.

Starts ``tokend serve`` on a free 127.0.0.1 port (on the embedded Redis, or on
``--redis URL``), opens ``--sessions`` sessions (default: as many as one process's
open-file limit allows, about 19,500 at 20,000) from several load-generator processes
(``bench.loadgen``, so that no client process exceeds its own limit), heartbeats each at
``--heartbeat`` seconds (default 30, the production cadence, staggered) for
``--duration`` seconds (default 600), then reports and stops everything it started:

* unexpected closes, by close code (must be 0),
* heartbeats sent and ACKed (must be equal), ACK latency p50/p99/max,
* server RSS after the sessions opened, its peak during the hold, and at the end,
* SESSION_WARN / TOKEN_EXPIRED events (must be 0).

Exit status 0 when all of that holds, 1 otherwise. Not part of CI: a ~5 s smoke run is
(tests/test_load_smoke.py).

    python load_tests/soak.py                                 # full: ~19,500 x 600 s
    python load_tests/soak.py --sessions 3000 --duration 60   # a short proof run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from redis import asyncio as aioredis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: bench/ and tests/

from bench.common import (  # noqa: E402
    QUICK,
    Context,
    client_pool,
    fd_limit,
    latency_summary,
    max_sessions,
    open_all,
    tokend_server,
)
from tokend.embedded import socket_url  # noqa: E402
from tokend.store import Keyspace  # noqa: E402

PER_CLIENT_PROCESS = 5000  # sessions per load-generator process (well under its fd limit)
CONNECT_CONCURRENCY = 50  # handshakes in flight per load-generator process
RSS_EVERY_S = 5.0  # how often the server's RSS is sampled during the hold
MB = 1 << 20


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sessions",
        type=int,
        default=max_sessions(),
        help=f"sessions to hold (default {max_sessions()}: the open-file limit {fd_limit()} "
        "less headroom)",
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument(
        "--heartbeat", type=float, default=30.0, help="heartbeat interval, s (default 30)"
    )
    parser.add_argument("--redis", default="", help="Redis URL (default: the embedded one)")
    parser.add_argument(
        "--clients", type=int, default=0, help="load-generator processes (default: 1 per 5000)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    return parser.parse_args(argv)


async def event_counts(redis_url: str, prefix: str) -> dict[str, int]:
    """Events of each type in the server's streams (WARN and EXPIRED must not appear)."""
    client = aioredis.from_url(redis_url, decode_responses=True)
    counts: dict[str, int] = {}
    try:
        for stream in Keyspace(prefix).streams():
            for _, fields in await client.xrange(stream):
                kind = json.loads(fields["event"])["type"]
                counts[kind] = counts.get(kind, 0) + 1
    finally:
        await client.aclose()
    return counts


async def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    ctx = Context(QUICK, workdir, "info", pin=False)  # info: the "listening" line
    # Tokens outlive the run, so the hold measures heartbeats (renewal has its own bench).
    tokens = ctx.tokens(args.sessions, ttl_s=int(max(3600, 4 * args.duration)))
    clocks = {
        "heartbeat_interval": args.heartbeat,
        "warn_after": 3 * args.heartbeat,
        "expire_after": 4 * args.heartbeat,
    }
    procs = args.clients or -(-args.sessions // PER_CLIENT_PROCESS)
    with tokend_server(ctx, args.redis, **clocks) as server:
        redis_url = args.redis or socket_url(server.log.parent)  # its data directory
        async with client_pool(
            ctx,
            "soak",
            url=server.url,
            proto="tokend",
            total=args.sessions,
            procs=procs,
            tokens=tokens,
        ) as pool:
            opened = await open_all(pool, CONNECT_CONCURRENCY)
            rss_open = server.rss()
            peak = rss_open
            hold = asyncio.ensure_future(
                pool.ask(
                    "soak",
                    timeout=args.duration + 60,
                    interval=args.heartbeat,
                    duration=args.duration,
                )
            )
            while not hold.done():
                await asyncio.wait([hold], timeout=RSS_EVERY_S)
                peak = max(peak, server.rss())
            replies = hold.result()
            rss_end = server.rss()
        events = await event_counts(redis_url, "bench")
    closes: dict[str, int] = {}
    for reply in replies:
        for code, count in reply["closes"].items():
            closes[code] = closes.get(code, 0) + count
    return {
        "sessions": opened["opened"],
        "client_processes": procs,
        "open_seconds": opened["seconds"],
        "duration_s": args.duration,
        "heartbeat_s": args.heartbeat,
        "unexpected_closes": closes,
        "heartbeats_sent": sum(r["sent"] for r in replies),
        "acks": sum(r["acks"] for r in replies),
        "ack_latency": latency_summary([x for r in replies for x in r["latencies_us"]]),
        "server_rss_mb": {
            "after_open": round(rss_open / MB, 1),
            "peak": round(peak / MB, 1),
            "end": round(rss_end / MB, 1),
        },
        "events": events,
    }


def verdict(figures: dict[str, Any]) -> list[str]:
    """What failed (empty: PASS)."""
    problems = []
    if figures["unexpected_closes"]:
        problems.append(f"unexpected closes {figures['unexpected_closes']}")
    if figures["acks"] != figures["heartbeats_sent"]:
        problems.append(f"{figures['heartbeats_sent'] - figures['acks']} heartbeats not ACKed")
    for kind in ("SESSION_WARN", "TOKEN_EXPIRED"):
        if figures["events"].get(kind):
            problems.append(f"{figures['events'][kind]} {kind}")
    return problems


def report(figures: dict[str, Any], problems: list[str]) -> str:
    latency = figures["ack_latency"]
    rss = figures["server_rss_mb"]
    return "\n".join(
        [
            f"sessions:           {figures['sessions']:,} from {figures['client_processes']} "
            f"client processes (opened in {figures['open_seconds']:.1f} s)",
            f"hold:               {figures['duration_s']:g} s, heartbeat every "
            f"{figures['heartbeat_s']:g} s",
            f"unexpected closes:  {sum(figures['unexpected_closes'].values())} "
            f"{figures['unexpected_closes'] or ''}".rstrip(),
            f"heartbeats:         {figures['heartbeats_sent']:,} sent, {figures['acks']:,} ACKed",
            f"ACK latency:        p50 {latency['p50_ms']:.2f} ms, p99 {latency['p99_ms']:.2f} ms, "
            f"max {latency['max_ms']:.2f} ms",
            f"server RSS:         {rss['after_open']} MB after open, peak {rss['peak']} MB, "
            f"{rss['end']} MB at the end",
            f"events:             {figures['events']}",
            f"result:             {'FAIL: ' + '; '.join(problems) if problems else 'PASS'}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    workdir = Path(tempfile.mkdtemp(prefix="tokend-soak-"))
    began = time.monotonic()
    try:
        figures = asyncio.run(soak(args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    figures["wall_s"] = round(time.monotonic() - began, 1)
    figures["workdir"] = str(workdir)  # removed, with everything started in it
    problems = verdict(figures)
    print(report(figures, problems))
    if args.json:
        args.json.write_text(json.dumps({**figures, "problems": problems}, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
