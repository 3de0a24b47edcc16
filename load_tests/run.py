"""Run a bounded tokend load test on loopback and summarize it on one screen.

Starts ``tokend serve`` on the embedded default (a private redis-server under a
temporary data directory) on a free 127.0.0.1 port, with the given heartbeat
cadence and token lifetime; runs locust headless (``load_tests/locustfile.py``)
for the given time and user count, its users minting their tokens with the
server's keys (the same ``TOKEND_*`` settings); counts the server's events;
stops the server (and so its Redis) and removes the temporary directory. Writes
to ``--out``:

* ``locust_stats.csv``, ``locust_failures.csv``, ``locust_stats_history.csv``,
  ``locust_exceptions.csv`` - locust's own CSV (rewritten every second while it
  runs, so they miss the last second: users logging out)
* ``locust_final.json`` - locust's final statistics, from which the summary is made
* ``locust.log``, ``server.log`` - their output
* ``summary.txt`` - the summary, also printed

Exit status 0 when every heartbeat was ACKed, nothing failed, no session warned
or expired and the server stopped on SIGTERM; 1 otherwise.

    python load_tests/run.py --users 500 --duration 60 --heartbeat 1 --ttl 10 --renew-window 5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import csv
import json
import math
import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from redis import asyncio as aioredis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: testkit/, bench/, load_tests/

from load_tests.common import scratch  # noqa: E402
from testkit.events import read_events  # noqa: E402
from testkit.net import LOOPBACK, free_port  # noqa: E402
from testkit.procs import terminate  # noqa: E402
from testkit.waiting import eventually_sync  # noqa: E402
from tokend.ops.embedded import socket_url  # noqa: E402

HERE = Path(__file__).resolve().parent
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


@dataclass(frozen=True)
class Plan:
    """What to run: users, timing and the server's clocks (seconds)."""

    users: int
    spawn_rate: float
    duration: int
    heartbeat: float
    ttl: int
    renew_window: float
    processes: int
    out: Path
    # Admin port for watching the run on the dashboard; None: no admin API.
    dashboard_port: int | None = None

    @property
    def warn_after(self) -> float:
        return 3 * self.heartbeat

    @property
    def expire_after(self) -> float:
        return 4 * self.heartbeat


def server_env(plan: Plan, data_dir: Path, port: int) -> dict[str, str]:
    """The settings of the server and of locust's token minting: no inherited TOKEND_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKEND_")}
    env.update(
        TOKEND_DATA_DIR=str(data_dir),
        TOKEND_HOST=LOOPBACK,
        TOKEND_PORT=str(port),
        TOKEND_NODE_NAME="load",
        # Ephemeral unless the dashboard is asked for: never collide with another server.
        TOKEND_ADMIN_PORT=str(plan.dashboard_port or 0),
        # Every locust user connects from 127.0.0.1: no per-address cap.
        TOKEND_MAX_CONNECTIONS_PER_IP="0",
        TOKEND_HEARTBEAT_INTERVAL=str(plan.heartbeat),
        TOKEND_WARN_AFTER=str(plan.warn_after),
        TOKEND_EXPIRE_AFTER=str(plan.expire_after),
        TOKEND_TOKEN_TTL=str(plan.ttl),
        TOKEND_RENEW_WINDOW=str(plan.renew_window),
        TOKEND_LOG_LEVEL="warning",
        TOKEND_LOG_FORMAT="json",
    )
    if plan.dashboard_port:
        env["TOKEND_ADMIN_TOKEN"] = secrets.token_urlsafe(24)
    return env


def wait_ready(port: int, server: subprocess.Popen[bytes]) -> None:
    """Until ``/readyz`` answers 200; raises if the server exits or takes too long."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def ready() -> bool:
        if server.poll() is not None:
            raise RuntimeError(f"tokend serve exited with {server.returncode}")
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            opener.open(f"http://{LOOPBACK}:{port}/readyz", timeout=1) as reply,
        ):
            return bool(reply.status == 200)
        return False

    eventually_sync(ready, START_TIMEOUT, interval=0.1, what="tokend serve ready")


def count_events(data_dir: Path) -> collections.Counter[str]:
    """Events per type in the server's streams (the embedded Redis, default prefix)."""

    async def count() -> collections.Counter[str]:
        client = aioredis.from_url(socket_url(data_dir), decode_responses=True)
        try:
            return collections.Counter(e["type"] for e in await read_events(client, "tokend"))
        finally:
            await client.aclose()

    return asyncio.run(count())


@dataclass(frozen=True)
class Outcome:
    """What the run left: the server's event counts, and how the server went."""

    events: collections.Counter[str]
    stopped: bool  # on SIGTERM, within STOP_TIMEOUT
    port: int
    pid: int
    workdir: Path  # removed at the end


def run(plan: Plan) -> Outcome:
    """Server, then locust; then stop the server and remove the temporary directory."""
    plan.out.mkdir(parents=True, exist_ok=True)
    with scratch("tokend-load-") as workdir:
        data_dir = workdir / "data"
        port = free_port()
        env = server_env(plan, data_dir, port)
        server: subprocess.Popen[bytes] | None = None
        locust: subprocess.Popen[bytes] | None = None
        try:
            with (plan.out / "server.log").open("wb") as server_log:
                server = subprocess.Popen(
                    [sys.executable, "-m", "tokend", "serve"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=server_log,
                    stderr=subprocess.STDOUT,
                )
            wait_ready(port, server)
            if plan.dashboard_port:
                print(
                    f"dashboard: http://{LOOPBACK}:{plan.dashboard_port}/dashboard"
                    f"#token={env['TOKEND_ADMIN_TOKEN']}",
                    flush=True,
                )
            command = [
                sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"),
                "--headless", "--users", str(plan.users), "--spawn-rate", str(plan.spawn_rate),
                "--run-time", f"{plan.duration}s", "--stop-timeout", "5",
                "--host", f"ws://{LOOPBACK}:{port}",
                "--csv", str(plan.out / "locust"), "--csv-full-history",
                "--json-file", str(plan.out / "locust_final"),
                "--only-summary", "--loglevel", "WARNING",
            ]  # fmt: skip
            if plan.processes > 1:
                command += ["--processes", str(plan.processes)]
            with (plan.out / "locust.log").open("wb") as locust_log:
                locust = subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=locust_log,
                    stderr=subprocess.STDOUT,
                )
            try:
                locust.wait(timeout=plan.duration + 120)
            except subprocess.TimeoutExpired:
                terminate(locust, 10)
                raise RuntimeError("locust did not finish in time") from None
            events = count_events(data_dir)
            return Outcome(events, terminate(server, STOP_TIMEOUT), port, server.pid, workdir)
        finally:
            for process in (locust, server):
                if process is not None:
                    terminate(process, 10)


@dataclass(frozen=True)
class Entry:
    """One line of locust's final statistics."""

    requests: int
    failures: int
    histogram: dict[int, int]  # response time (ms, as locust rounds it) -> count
    per_second: dict[int, int]  # epoch second -> requests
    max_ms: float

    def percentile(self, fraction: float) -> int:
        """The response time (ms) that ``fraction`` of the requests did not exceed."""
        rank, seen = math.ceil(fraction * sum(self.histogram.values())), 0
        for ms in sorted(self.histogram):
            seen += self.histogram[ms]
            if seen >= rank:
                return ms
        return 0

    def latency(self) -> str:
        if not self.requests:
            return "-"
        p50, p95, p99 = (self.percentile(f) for f in (0.5, 0.95, 0.99))
        return f"p50 {p50} ms  p95 {p95} ms  p99 {p99} ms  max {self.max_ms:.0f} ms"

    def steady_rate(self, skip_s: float) -> float:
        """Requests/s over the whole seconds after the first ``skip_s`` s and before the last."""
        if not self.per_second:
            return 0.0
        first, last = min(self.per_second), max(self.per_second)
        seconds = range(first + math.ceil(skip_s) + 1, last)
        if not seconds:
            seconds = range(first, last + 1)
        return sum(self.per_second.get(t, 0) for t in seconds) / len(seconds)


EMPTY = Entry(0, 0, {}, {}, 0.0)


def read_final(out: Path) -> dict[str, Entry]:
    """Locust's final statistics by request name."""
    rows = json.loads((out / "locust_final.json").read_text())
    return {
        row["name"]: Entry(
            row["num_requests"],
            row["num_failures"],
            {int(ms): n for ms, n in row["response_times"].items()},
            {int(t): n for t, n in row["num_reqs_per_sec"].items()},
            row["max_response_time"] or 0.0,
        )
        for row in rows
    }


def steady_latency(out: Path, name: str, ramp_s: float) -> str:
    """Worst p50/p95/p99 of locust's 10 s windows that lie wholly after the ramp-up."""
    with (out / "locust_stats_history.csv").open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["Name"] == name]
    if not rows:
        return "-"
    start = int(rows[0]["Timestamp"]) + ramp_s + 10
    steady = [r for r in rows[:-2] if int(r["Timestamp"]) >= start]  # the end is logout
    if not steady:
        return "-"
    p50, p95, p99 = (max(int(r[col]) for r in steady) for col in ("50%", "95%", "99%"))
    return f"p50 {p50} ms  p95 {p95} ms  p99 {p99} ms (worst 10 s window after ramp-up)"


def failure_lines(out: Path, limit: int = 5) -> list[str]:
    """The most frequent failure messages from locust's failures CSV."""
    with (out / "locust_failures.csv").open() as fh:
        rows = sorted(csv.DictReader(fh), key=lambda r: -int(r["Occurrences"]))
    return [f"{r['Occurrences']} x {r['Name']}: {r['Error']}" for r in rows[:limit]]


def summarize(plan: Plan, outcome: Outcome) -> tuple[str, bool]:
    """The one-screen summary and whether the run passed."""
    events = outcome.events
    stats = read_final(plan.out)
    hb = stats.get("heartbeat", EMPTY)
    hello = stats.get("connect+hello", EMPTY)
    renewals = stats.get("renewal", EMPTY).requests
    failures = sum(entry.failures for entry in stats.values())
    failed_text = ", ".join(f"{n} {e.failures}" for n, e in stats.items() if e.failures) or "none"
    ramp_s = plan.users / plan.spawn_rate
    lines = [
        f"tokend load test: {plan.users} users for {plan.duration} s "
        f"(spawn {plan.spawn_rate:g}/s, {plan.processes} locust process(es))",
        f"server clocks: heartbeat {plan.heartbeat:g} s, warn {plan.warn_after:g} s, "
        f"expire {plan.expire_after:g} s, token ttl {plan.ttl} s, "
        f"renew window {plan.renew_window:g} s",
        f"heartbeats:    {hb.requests} sent, {hb.failures} failed; "
        f"{hb.steady_rate(ramp_s):.1f}/s once all users run "
        f"(target {plan.users / plan.heartbeat:.1f}/s)",
        f"ACK latency:   {hb.latency()} (whole run)",
        f"               {steady_latency(plan.out, 'heartbeat', ramp_s)}",
        f"connect+hello: {hello.requests} sent, {hello.failures} failed; {hello.latency()}",
        f"renewals:      {renewals} seen by clients, {events['TOKEN_RENEWED']} TOKEN_RENEWED "
        "by the server",
        f"failures:      {failures} ({failed_text})",
        *(f"  {line}" for line in failure_lines(plan.out)),
        "server events: " + ", ".join(f"{kind} {count}" for kind, count in sorted(events.items())),
        f"server:        ws://{LOOPBACK}:{outcome.port} pid {outcome.pid}, stopped "
        + ("on SIGTERM" if outcome.stopped else f"by SIGKILL: SIGTERM took over {STOP_TIMEOUT:g} s")
        + f"; {outcome.workdir} removed",
        f"files:         {plan.out}/locust_stats.csv (+ _failures, _stats_history, "
        "_exceptions), locust_final.json, summary.txt, locust.log, server.log",
    ]
    passed = (
        hb.requests > 0
        and failures == 0
        and outcome.stopped
        and not events["TOKEN_EXPIRED"]
        and not events["SESSION_WARN"]
    )
    lines.append(f"result:        {'PASS' if passed else 'FAIL'}")
    return "\n".join(lines) + "\n", passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=100, help="simulated users (default 100)")
    parser.add_argument(
        "--spawn-rate", type=float, help="users started per second (default: min(users, 100))"
    )
    parser.add_argument("--duration", type=int, default=30, help="seconds of load (default 30)")
    parser.add_argument(
        "--heartbeat", type=float, default=1.0, help="server heartbeat interval, s (default 1)"
    )
    parser.add_argument(
        "--ttl", type=int, default=10, help="token lifetime and token_ttl, s (default 10)"
    )
    parser.add_argument(
        "--renew-window", type=float, default=5.0, help="server renew_window, s (default 5)"
    )
    parser.add_argument(
        "--processes", type=int, default=1, help="locust worker processes (default 1)"
    )
    parser.add_argument("--out", type=Path, default=Path("load-results"), help="output directory")
    parser.add_argument(
        "--dashboard",
        type=int,
        metavar="PORT",
        help="serve the admin listener on PORT with a fresh admin token and print the "
        "dashboard's URL, to watch the run (default: no admin API)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.users <= 10_000 or not 1 <= args.duration <= 3600:
        parser.error("users must be 1..10000 and duration 1..3600 s")
    plan = Plan(
        users=args.users,
        spawn_rate=args.spawn_rate or min(args.users, 100),
        duration=args.duration,
        heartbeat=args.heartbeat,
        ttl=args.ttl,
        renew_window=args.renew_window,
        processes=args.processes,
        out=args.out,
        dashboard_port=args.dashboard,
    )
    summary, passed = summarize(plan, run(plan))
    (plan.out / "summary.txt").write_text(summary)
    print(summary, end="")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
