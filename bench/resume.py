"""Resume storm: sessions that exist reconnect at once, each with its token and proof.

``connects`` sessions are opened, then every connection is dropped (a reset, as a
client's crash or a restart of the server's workers leaves them): the store holds the
sessions. Then all reconnect at once, ``concurrency`` in flight per client process,
each presenting its token and the resume proof of its last WELCOME's key (spec
"Resume proof"), as the SDK does. Measured: sessions resumed per second per worker and
the server's CPU per resume (the steadier figure on a shared machine).

The baseline is the bare websockets server of :mod:`bench.bare_server` doing the
handshake, the HELLO and its Ed25519 verification, driven the same way (open, drop,
reconnect; the second round is measured); the picows server beside it is the load
generator's ceiling. With ``--profile`` py-spy samples tokend during the resume storm
and the heaviest functions are printed (self and inclusive samples).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench import connect_storm
from bench.common import (
    BenchError,
    Child,
    Context,
    Row,
    open_all,
    ratio,
)
from testkit.net import LOOPBACK
from testkit.procs import CpuMeter

RATE_TARGET = 2.0  # x the bare websockets server's handshake + HELLO + Ed25519 verify
PROFILE_TOP = 25  # functions printed by --profile
PROFILE_RATE = 500  # py-spy samples per second
IDLE_CPU_PCT = 5.0  # below this the server is done with the drops
IDLE_WAIT_S = 30.0  # how long to wait for it
DROP_WAIT_S = 120.0  # how long the server may take to see every connection gone


def server_connections(port: int, address: str = LOOPBACK) -> int:
    """TCP connections whose server end is ``address``:``port`` (not listening, not in
    TIME_WAIT), from /proc/net/tcp: those the server has not closed yet.

    The address counts as much as the port: a socket from another loopback address may
    have the same port (the server's port came from the ephemeral range, where the load
    generators of load_tests/, from 127.0.0.2 and up, hold thousands of theirs), and it
    is none of the server's.
    """
    local = f"{int.from_bytes(socket.inet_aton(address), 'little'):08X}:{port:04X}"
    count = 0
    with open("/proc/net/tcp") as lines:
        next(lines)
        for line in lines:
            fields = line.split()
            if fields[1] == local and fields[3] not in (_LISTEN, _TIME_WAIT):
                count += 1
    return count


_LISTEN, _TIME_WAIT = "0A", "06"


async def server_saw_drops(server: Child) -> None:
    """Wait until the server has closed every dropped connection, and until it is idle
    again (each session released in the store), or ``IDLE_WAIT_S`` has passed (on a
    shared machine a neighbour's work may keep the figure above the bar): the resume
    storm is measured alone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DROP_WAIT_S
    while server_connections(server.port):
        if loop.time() > deadline:
            raise BenchError(f"{server.name} still holds connections {DROP_WAIT_S:.0f} s on")
        await asyncio.sleep(0.2)
    idle_by = loop.time() + IDLE_WAIT_S
    while loop.time() < idle_by:
        meter = CpuMeter({"server": server.pid})
        meter.start()
        await asyncio.sleep(0.5)
        if meter.stop()["server"] <= IDLE_CPU_PCT:
            return
    print(f"[bench] {server.name} not idle {IDLE_WAIT_S:.0f} s after the drops", file=sys.stderr)


class Profiler:
    """py-spy sampling a server (and its workers) into a raw (collapsed stacks) file."""

    def __init__(self, ctx: Context, pid: int) -> None:
        self.out = ctx.scratch("profile") / "resume.txt"
        py_spy = str(Path(sys.executable).with_name("py-spy"))
        argv = [py_spy, "record", "-p", str(pid), "-f", "raw", "-o", str(self.out)]
        argv += ["--subprocesses", "--nolineno", "--rate", str(PROFILE_RATE)]
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> str:
        """End sampling (SIGINT writes the file); the top functions as text."""
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if not self.out.exists():
            return "profile: py-spy wrote nothing"
        return top_functions(self.out.read_text())


def top_functions(collapsed: str, top: int = PROFILE_TOP) -> str:
    """The functions with the most samples on the stack (inclusive) and at its top (self)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not total:
        return "profile: no samples"
    lines = [f"profile: {total} samples"]
    for title, counts in (("self", own), ("inclusive", inclusive)):
        lines.append(f"  top {top} by {title} samples:")
        lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in counts.most_common(top)]
    return "\n".join(lines)


async def storm(ctx: Context, proto: str, server: Child, pids: dict[str, int]) -> dict[str, Any]:
    """Open ``connects`` sessions, drop them, and reconnect them all at once: rate,
    latency and CPU of the reconnect."""
    sizes = ctx.sizes
    async with connect_storm.session_pool(ctx, proto, server) as pool:
        await open_all(pool, sizes.concurrency)
        await pool.ask("drop", timeout=60)
        await server_saw_drops(server)
        profiler = Profiler(ctx, server.pid) if ctx.profile and proto == "tokend" else None
        meter = CpuMeter({proto: server.pid, **pids})
        meter.start()
        figures = await open_all(pool, sizes.concurrency)
        cpu = meter.stop()
        profile = profiler.stop() if profiler is not None else ""
    cpu["clients"] = round(100 * figures["client_cpu_s"] / figures["seconds"], 1)
    return {**figures, "cpu_pct": cpu, "profile": profile}


def describe(name: str, figures: dict[str, Any]) -> str:
    return connect_storm.describe(name, figures, "resume")


async def run(ctx: Context) -> list[Row]:
    ceiling = await connect_storm.figures(ctx, "picows", measure=storm)
    bare = await connect_storm.figures(ctx, "bare", measure=storm)
    tokend = await connect_storm.figures(ctx, "tokend", measure=storm)
    workers = ctx.workers
    per_worker = tokend["rate"] / workers
    rate_ratio = ratio(per_worker, bare["rate"])
    resumed = tokend["resumed"]
    in_flight = ctx.sizes.clients * ctx.sizes.concurrency
    notes = [
        describe("tokend", tokend),
        describe("bare", bare),
        describe("client ceiling (picows server)", ceiling),
    ]
    if resumed != tokend["opened"]:
        notes.insert(0, f"only {resumed:,} of {tokend['opened']:,} were resumed")
    if tokend["profile"]:
        print(tokend["profile"], file=sys.stderr)
    return [
        Row(
            "resume storm",
            f"sessions resumed/s per worker, {ctx.sizes.connects:,} ({in_flight} in flight)",
            per_worker,
            "/s",
            f">= {RATE_TARGET}x bare",
            rate_ratio is not None and rate_ratio >= RATE_TARGET and resumed == tokend["opened"],
            "bare handshake+HELLO+verify",
            bare["rate"],
            rate_ratio,
            " | ".join(notes),
            {"tokend": tokend, "bare": bare, "client_ceiling": ceiling, "workers": workers},
        )
    ]
