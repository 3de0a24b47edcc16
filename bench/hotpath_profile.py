"""The heartbeat and renewal hot path counted in one process, repeatably (issue 22).

A real :class:`tokend.server.node.Node` with its real batchers and Redis client, against a
private redis-server, serves ``--connections`` real :class:`tokend.server.connection.Connection`
objects through a real :class:`tokend.server.admission.Admission`. Only their sockets are fake
(:class:`Socket` keeps what is written). Each connection is opened by a real upgrade
request and HELLO; then each round feeds every connection one masked heartbeat frame
through ``data_received``, as the event loop would, ``--batch`` connections at a time:
their heartbeats go to Redis in one flush, whose ACKs are awaited before the next
``--batch`` are fed (so the count of round trips is the same in every run). With
``--renewal`` every heartbeat renews its token (``renew_window`` covers the tokens'
life; rounds are a second apart, as a renewal needs a new whole second).

What it reports, per ACK (or per renewal), for tokend's process only (not Redis, not the
kernel's side of a real socket, not the frames the harness makes, which are made before
the rounds):

* ``cpu``: ``time.process_time()`` over the rounds (noisy on a shared machine);
* ``--cprofile``: Python calls per ACK and the top functions by own time;
* ``--callgrind``: instructions per ACK, counted by ``valgrind --tool=callgrind`` (the
  figure to compare code versions with: the same whatever else runs on the machine).
  The harness runs itself twice under callgrind, with ``--rounds`` and with twice as
  many, identical but for the extra rounds; the difference in instructions over the
  difference in ACKs is the per-ACK cost, start-up and connection opening cancelled.

    python -m bench.hotpath_profile                       # CPU per ACK, 200 x 50
    python -m bench.hotpath_profile --callgrind           # instructions per ACK
    python -m bench.hotpath_profile --renewal --callgrind # instructions per renewal
    python -m bench.hotpath_profile --cprofile            # calls per ACK, top functions
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from websockets.frames import Frame, Opcode

from bench.common import callgrind_instructions, print_profile
from testkit.clients import upgrade_request
from testkit.redis_servers import RedisProcess
from tokend import config, logs
from tokend.core import protocol as p
from tokend.server.admission import Admission
from tokend.server.connection import Connection
from tokend.server.node import Node
from tokend.store.redis_client import open_client
from tokend.tokens.keys import KeyRing
from tokend.tokens.service import TokenService

# Renewal mode: every heartbeat is inside the renew window of a token minted for 60 s.
RENEWAL_SETTINGS = {"token_ttl": 120, "renew_window": 119}
RENEWAL_MINTED_TTL_S = 60
RENEWAL_GAP_S = 1.05  # a renewal needs a new whole second of Redis time
ACK_TYPE = p.FrameType.HEARTBEAT_ACK.value  # a module constant: an Enum's is a slow read
# Seconds without a write while the harness waits for one: something is wrong.
STALLED_S = 60


class Socket(asyncio.Transport):
    """A connection's socket: counts the frames written after WELCOME, and their renewals."""

    def __init__(self, harness: Harness, port: int) -> None:
        super().__init__()
        self.harness = harness
        self.port = port
        self.written: list[bytes] = []
        self.counting = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.counting:
            self.written.append(bytes(data))
            self.harness.wrote(None)
            return
        # One write per flush and connection: here one ACK (a frame's payload begins at
        # byte 2, or 4 with a 16-bit length: a renewed ACK carries a token). What the
        # harness does per ACK is counted with tokend's: kept to a few operations.
        at = 4 if data[1] == 126 else 2
        if data[at] != ACK_TYPE:
            raise RuntimeError(f"not an ACK: {bytes(data[:8]).hex()}")
        self.harness.wrote(data[at + 1] & p.ACK_RENEWED)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def can_write_eof(self) -> bool:
        return True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", self.port) if name == "peername" else default

    def write_eof(self) -> None:
        pass

    def close(self) -> None:
        raise RuntimeError("the harness closes no connection")

    def abort(self) -> None:
        raise RuntimeError("the harness aborts no connection")


def masked_binary(payload: bytes) -> bytes:
    """A client's masked binary frame (a random masking key, as a client's)."""
    return Frame(Opcode.BINARY, payload).serialize(mask=True, extensions=[])


class Harness:
    """A node and its connections in this process; see the module."""

    def __init__(self, connections: int, *, renewal: bool, batch: int) -> None:
        self.size = connections
        self.renewal = renewal
        self.batch = batch
        self.writes = 0  # to every socket
        self.awaited = 0  # wait() returns once writes reach it
        self.acks = 0
        self.renewed = 0
        # What wait() awaits, resolved by the write it waits for. No timeout per wait (its
        # timer and task would be counted per flush): a watchdog (stalled) instead.
        self.done: asyncio.Future[None] | None = None

    def wrote(self, renewed: int | None) -> None:
        """A write to a socket: an ACK once counting (``renewed`` nonzero for a renewal),
        else (None) the 101 or the WELCOME."""
        self.writes += 1
        if renewed is not None:
            self.acks += 1
            if renewed:
                self.renewed += 1
        if self.writes == self.awaited and self.done is not None:
            self.done.set_result(None)
            self.done = None

    async def wait(self, count: int) -> None:
        """Until ``count`` more writes than at the last wait have been made."""
        self.awaited += count
        if self.writes < self.awaited:
            self.done = asyncio.get_running_loop().create_future()
            await self.done

    async def stalled(self) -> None:
        """Fail the wait under way when no write came for STALLED_S seconds."""
        writes = -1
        while True:
            await asyncio.sleep(STALLED_S)
            if self.done is not None and self.writes == writes:
                self.done.set_exception(TimeoutError(f"no write for {STALLED_S} s"))
                self.done = None
            writes = self.writes

    async def run(self, workdir: Path, rounds: int, measured: int, profile: bool) -> dict[str, Any]:
        """Open the connections, make ``rounds`` rounds of frames, feed ``measured`` of them."""
        redis = RedisProcess(workdir / "redis")
        redis.start()
        watchdog = asyncio.create_task(self.stalled())
        try:
            return await self._run(redis.url, workdir, rounds, measured, profile)
        finally:
            watchdog.cancel()
            redis.stop()

    async def _run(
        self, url: str, workdir: Path, rounds: int, measured: int, profile: bool
    ) -> dict[str, Any]:
        values: dict[str, Any] = {
            "redis_url": url,
            "keys_dir": str(workdir / "keys"),
            "max_frame_rate": 0,
            "max_connections_per_ip": 0,
            "shed_lag": 0,
            "log_level": "warning",
            # Generous: under valgrind everything is tens of times slower.
            "redis_timeout": 30,
            "hello_timeout": 60,
            # Work paced by the clock (10 sweeps a second, the failover check) is no part
            # of a heartbeat's cost, and under valgrind it would grow with the run's time.
            "sweep_interval": 60,
            "failover_check_interval": 60,
        }
        if self.renewal:
            values |= RENEWAL_SETTINGS
        settings = config.load(values, environ={})
        logs.configure("json", "warning")
        tokens = TokenService(settings, KeyRing.open(settings.resolved_keys_dir))
        node = Node(settings, open_client(url, settings), tokens, name="bench")
        await node.start()
        try:
            return await self._serve(node, settings, tokens, rounds, measured, profile)
        finally:
            await node.stop()

    async def _serve(
        self,
        node: Node,
        settings: config.Settings,
        tokens: TokenService,
        rounds: int,
        measured: int,
        profile: bool,
    ) -> dict[str, Any]:
        admission = Admission(settings, node, None)
        ttl = RENEWAL_MINTED_TTL_S if self.renewal else 3600
        connections = []
        for n in range(self.size):
            connection = Connection(admission)
            socket = Socket(self, 20000 + n)
            connection.connection_made(socket)
            connection.data_received(upgrade_request())
            connection.data_received(
                masked_binary(p.encode(p.Hello(tokens.mint(f"u{n}", ttl_s=ttl))))
            )
            connections.append((connection, socket))
        await self.wait(2 * self.size)  # the 101 and the WELCOME
        frames = []
        for _, socket in connections:
            welcome = p.decode(socket.written[-1][2:])
            assert isinstance(welcome, p.Welcome), welcome
            socket.counting = True
            frames.append(
                [
                    masked_binary(
                        p.encode(
                            p.make_heartbeat(welcome.session_key, welcome.tid, seq, welcome.exp_ms)
                        )
                    )
                    for seq in range(1, rounds + 1)
                ]
            )
        feeds = [connection.data_received for connection, _ in connections]
        # What was made so far is never collected: a full collection (its cost is every
        # object's) would fall in one run's rounds and not in the other's.
        gc.collect()
        gc.freeze()
        profiler = cProfile.Profile() if profile else None
        cpu = wall = 0.0
        for r in range(measured):
            if self.renewal:
                await asyncio.sleep(RENEWAL_GAP_S)
            began, wall_began = time.process_time(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
            for start in range(0, self.size, self.batch):
                group = feeds[start : start + self.batch]
                for feed, beats in zip(group, frames[start:], strict=False):
                    feed(beats[r])
                await self.wait(len(group))  # one flush stores them and writes their ACKs
            if profiler is not None:
                profiler.disable()
            cpu += time.process_time() - began
            wall += time.perf_counter() - wall_began
        figures: dict[str, Any] = {
            "acks": self.acks,
            "renewed": self.renewed,
            "cpu_us_per_ack": cpu / self.acks * 1e6 if self.acks else 0.0,
            "wall_us_per_ack": wall / self.acks * 1e6 if self.acks else 0.0,
        }
        if profiler is not None:
            figures["profile"] = profiler
        return figures


def _in_process(args: argparse.Namespace, rounds: int, measured: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tokend-hotpath-") as workdir:
        harness = Harness(args.connections, renewal=args.renewal, batch=args.batch)
        # On uvloop, as `tokend serve` runs.
        return uvloop.run(harness.run(Path(workdir), rounds, measured, args.cprofile))


def _callgrind(args: argparse.Namespace) -> dict[str, Any]:
    """Instructions per ACK: two runs under callgrind, identical but for the rounds fed."""
    counts = []
    with tempfile.TemporaryDirectory(prefix="tokend-callgrind-") as workdir:
        for measured in (args.rounds, 2 * args.rounds):
            out = Path(workdir) / f"callgrind.{measured}"
            module_args = [
                "bench.hotpath_profile",
                "--connections",
                str(args.connections),
                "--batch",
                str(args.batch),
                "--rounds",
                str(2 * args.rounds),
                "--feed",
                str(measured),
                *(["--renewal"] if args.renewal else []),
            ]
            counts.append(callgrind_instructions(module_args, out))
            if args.keep:
                kept = Path(args.keep) / out.name
                kept.write_bytes(out.read_bytes())
    acks = args.rounds * args.connections
    return {"instructions": counts, "instructions_per_ack": (counts[1] - counts[0]) / acks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument(
        "--batch", type=int, default=50, help="heartbeats per flush (per Redis round trip)"
    )
    parser.add_argument("--rounds", type=int, default=50, help="heartbeats per connection")
    parser.add_argument("--renewal", action="store_true", help="every heartbeat renews")
    parser.add_argument("--cprofile", action="store_true", help="calls per ACK, top functions")
    parser.add_argument("--callgrind", action="store_true", help="instructions per ACK")
    parser.add_argument("--keep", help="--callgrind: keep the callgrind files in this directory")
    parser.add_argument("--feed", type=int, help=argparse.SUPPRESS)  # of --rounds (callgrind)
    args = parser.parse_args()
    what = "renewal" if args.renewal else "ACK"
    if args.callgrind:
        figures = _callgrind(args)
        print(
            f"{figures['instructions_per_ack']:,.0f} instructions per {what} "
            f"({args.connections} connections, {args.rounds} rounds more in the second run; "
            f"totals {figures['instructions'][0]:,} and {figures['instructions'][1]:,})"
        )
        return
    measured = args.rounds if args.feed is None else args.feed
    figures = _in_process(args, args.rounds, measured)
    if args.feed is not None:
        return
    if args.renewal and figures["renewed"] != figures["acks"]:
        print(f"warning: {figures['renewed']} of {figures['acks']} ACKs renewed", file=sys.stderr)
    print(
        f"{figures['cpu_us_per_ack']:.1f} us CPU, {figures['wall_us_per_ack']:.1f} us of time "
        f"per {what} (process_time, perf_counter; "
        f"{figures['acks']:,} ACKs, {figures['renewed']:,} renewed)"
    )
    profiler = figures.get("profile")
    if profiler is not None:
        print_profile(profiler, figures["acks"], what, 25)


if __name__ == "__main__":
    main()
