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

import argparse
import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import connect_storm
from bench.common import (
    QUICK,
    BenchError,
    Child,
    ClientPool,
    Context,
    Row,
    bare_child,
    open_all,
    ratio,
    redis_server,
    tokend_child,
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


@contextlib.asynccontextmanager
async def dropped(ctx: Context, proto: str, server: Child) -> AsyncIterator[ClientPool]:
    """``connects`` sessions opened, then dropped, and the server done with the drops:
    the pool whose next ``open_all`` resumes them all at once."""
    async with connect_storm.session_pool(ctx, proto, server) as pool:
        await open_all(pool, ctx.sizes.concurrency)
        await pool.ask("drop", timeout=60)
        await server_saw_drops(server)
        yield pool


async def storm(ctx: Context, proto: str, server: Child, pids: dict[str, int]) -> dict[str, Any]:
    """Open ``connects`` sessions, drop them, and reconnect them all at once: rate,
    latency and CPU of the reconnect."""
    async with dropped(ctx, proto, server) as pool:
        profiler = Profiler(ctx, server.pid) if ctx.profile and proto == "tokend" else None
        meter = CpuMeter({proto: server.pid, **pids})
        meter.start()
        figures = await open_all(pool, ctx.sizes.concurrency)
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


# Instructions per resume: ``python -m bench.resume``


async def counted(ctx: Context, server: Child, out: Path) -> dict[str, Any]:
    """The resume storm against ``server`` (running under callgrind, instrumentation
    off): the instructions it executed while the sessions resumed, and while idle."""
    proto = "tokend" if server.name == "tokend" else "bare"
    async with dropped(ctx, proto, server) as pool:
        await callgrind(server.pid, "--zero", "--instr=on")
        figures = await open_all(pool, ctx.sizes.concurrency)
        storm_ir = await callgrind_dump(server.pid, out)
        # The timers a server runs anyway (tokend's sweeps): their share of the figure.
        await asyncio.sleep(IDLE_SAMPLE_S)
        idle_ir = await callgrind_dump(server.pid, out)
        await callgrind(server.pid, "--instr=off")
    opened = figures["opened"]
    idle_per_s = idle_ir / IDLE_SAMPLE_S
    return {
        "resumed": figures["resumed"] if proto == "tokend" else opened,
        "opened": opened,
        "seconds": figures["seconds"],
        "instructions": storm_ir,
        "idle_per_s": idle_per_s,
        "per_resume": (storm_ir - idle_per_s * figures["seconds"]) / opened,
        "profile": str(out),
    }


IDLE_SAMPLE_S = 5.0  # seconds of idle counted after the storm
# tokend's settings while counted. Its timers tick by the wall clock, which valgrind
# stretches ~50x for the resumes but not for them: the shedder's 100 samples a second
# (off: it sheds nothing in this storm) and 10 sweeps (1) would be half of the count.
# What is left is measured idle and taken off. The opening, HELLO and Redis calls take
# longer under valgrind, the longer the busier the machine: not a timeout's business.
COUNTED_SETTINGS = {"shed_lag": 0, "sweep_interval": 1.0, "hello_timeout": 60, "redis_timeout": 60}
VALGRIND_START_S = 600.0  # a server's start under valgrind (uninstrumented, but slow)


async def callgrind(pid: int, *commands: str) -> None:
    """Tell the callgrind running ``pid`` (``callgrind_control``: zero, instr=on, dump...)."""
    done = await asyncio.create_subprocess_exec(
        "callgrind_control",
        *commands,
        str(pid),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await done.communicate()
    if done.returncode:
        raise BenchError(f"callgrind_control {' '.join(commands)}: {output.decode()}")


async def callgrind_dump(pid: int, out: Path) -> int:
    """Dump the counts since the last dump (or zero) to a new file beside ``out``; their
    total (instructions)."""
    before = set(out.parent.glob(out.name + ".*"))
    await callgrind(pid, "--dump")
    (dump,) = set(out.parent.glob(out.name + ".*")) - before
    for line in dump.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise BenchError(f"no totals in {dump}")


def under_callgrind(child: Child, out: Path) -> Child:
    """``child`` run by callgrind, instrumentation off until :func:`counted` turns it on."""
    child.argv = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        *child.argv,
    ]
    return child


async def instructions(ctx: Context, name: str) -> dict[str, Any]:
    """:func:`counted` for tokend (with its Redis) or the bare websockets server."""
    out = ctx.scratch(f"callgrind-{name}") / "callgrind.out"
    with contextlib.ExitStack() as stack:
        if name == "tokend":
            store = stack.enter_context(redis_server(ctx))
            server = tokend_child(ctx, store.url, **COUNTED_SETTINGS)
        else:
            server = bare_child(ctx, "websockets", verify=True)
        under_callgrind(server, out)
        stack.callback(server.stop)
        server.start('"listening"' if name == "tokend" else "listening", VALGRIND_START_S)
        return await counted(ctx, server, out)


async def count_all(ctx: Context, names: list[str]) -> None:
    results = {name: await instructions(ctx, name) for name in names}
    for name, figures in results.items():
        print(
            f"{name}: {figures['resumed']:,} of {figures['opened']:,} resumed in "
            f"{figures['seconds']:.1f} s under "
            f"callgrind, {figures['instructions']:,} instructions, idle "
            f"{figures['idle_per_s']:,.0f}/s: {figures['per_resume']:,.0f} per resume; "
            f"counts in {figures['profile']}.*"
        )
    if len(results) == 2:
        print(
            f"tokend/bare: {results['tokend']['per_resume'] / results['bare']['per_resume']:.3f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.resume",
        description="Instructions a server executes per resume, counted by callgrind "
        "(repeatable whatever else the machine does): tokend against the bare websockets "
        "server doing handshake + HELLO + Ed25519 verify.",
    )
    parser.add_argument("--sessions", type=int, default=1000, help="sessions resumed")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--concurrency", type=int, default=4, help="in flight per client")
    parser.add_argument(
        "--server", choices=("tokend", "bare"), nargs="+", default=["tokend", "bare"]
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir (counts, logs)")
    args = parser.parse_args()
    sizes = replace(
        QUICK, connects=args.sessions, clients=args.clients, concurrency=args.concurrency
    )
    workdir = Path(tempfile.mkdtemp(prefix="tokend-resume-count-"))
    try:
        asyncio.run(count_all(Context(sizes, workdir, "info", pin=False), args.server))
    finally:
        if args.keep:
            print(f"scratch dir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
