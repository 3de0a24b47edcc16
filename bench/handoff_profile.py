"""The rolling reload's handoff counted in one process, repeatably: the CPU per moved
connection, old and new worker together.

Two real :class:`tokend.ops.app.App` workers (their nodes, admissions and listeners) in
this process, on uvloop, against a private redis-server. ``--connections`` real TCP
clients, WELCOMEd by the first worker, stay idle; then each round hands every connection
from one worker to the other over a SOCK_SEQPACKET socketpair (a
:class:`tokend.server.handoff.Giver` to a :class:`tokend.server.handoff.Taker`, as a
reload's two workers of a slot do), the next round back again. Once the rounds are done,
every client heartbeats and must be ACKed by the worker that holds it last.

What it reports, per moved connection, for tokend's two workers together (not Redis, not
the kernel's side of the clients' sockets; the clients do nothing meanwhile):

* ``cpu``: ``time.process_time()`` over the rounds (noisy on a shared machine);
* ``--cprofile``: Python calls per moved connection and the top functions by own time;
* ``--callgrind``: instructions per moved connection, counted by ``valgrind
  --tool=callgrind`` over two runs identical but for the rounds measured (start-up and
  the clients' opening cancelled): the figure to compare code versions with, the same
  whatever else runs on the machine.

    python -m bench.handoff_profile                 # CPU per moved connection
    python -m bench.handoff_profile --cprofile      # calls, top functions
    python -m bench.handoff_profile --callgrind     # instructions per moved connection
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from websockets.frames import Frame, Opcode

from bench.common import callgrind_instructions, print_profile
from testkit.clients import upgrade_request
from testkit.net import LOOPBACK
from testkit.procs import fd_limit
from testkit.redis_servers import RedisProcess
from tokend import config, logs
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.server.handoff import Giver, Taker
from tokend.tokens.keys import KeyRing
from tokend.tokens.service import TokenService

# Calm clocks: nothing is due while the clients idle through the rounds.
CLOCKS = {"heartbeat_interval": 60.0, "warn_after": 240.0, "expire_after": 360.0}
OPEN_AT_ONCE = 100  # clients in their opening handshake and HELLO at a time


def masked_binary(payload: bytes) -> bytes:
    return Frame(Opcode.BINARY, payload).serialize(mask=True, extensions=[])


async def read_frame(sock: socket.socket, buffered: bytearray) -> bytes:
    """The payload of the next short unmasked binary frame from the server."""
    loop = asyncio.get_running_loop()
    while len(buffered) < 2 or len(buffered) < 2 + _payload_length(buffered):
        data = await loop.sock_recv(sock, 4096)
        if not data:
            raise ConnectionError("closed by the server")
        buffered += data
    size = _payload_length(buffered)
    at = 4 if buffered[1] == 126 else 2
    payload = bytes(buffered[at : at + size])
    del buffered[: at + size]
    return payload


def _payload_length(buffered: bytearray) -> int:
    length = buffered[1] & 0x7F
    if length == 126:
        return 2 + int.from_bytes(buffered[2:4]) if len(buffered) >= 4 else 1 << 20
    return length


class Client:
    """One idle client: its socket and its WELCOME."""

    def __init__(self, sock: socket.socket, welcome: p.Welcome) -> None:
        self.sock = sock
        self.welcome = welcome

    @classmethod
    async def open(cls, port: int, token: str) -> Client:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, (LOOPBACK, port))
        await loop.sock_sendall(sock, upgrade_request())
        head = b""
        while b"\r\n\r\n" not in head:
            head += await loop.sock_recv(sock, 4096)
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(head.decode(errors="replace"))
        buffered = bytearray(head.split(b"\r\n\r\n", 1)[1])
        await loop.sock_sendall(sock, masked_binary(p.encode(p.Hello(token))))
        welcome = p.decode(await read_frame(sock, buffered))
        if not isinstance(welcome, p.Welcome):
            raise ConnectionError(f"not a WELCOME: {welcome}")
        return cls(sock, welcome)

    async def heartbeat(self) -> None:
        """One heartbeat, ACKed (seq 1: the clients sent none before)."""
        loop = asyncio.get_running_loop()
        w = self.welcome
        beat = p.make_heartbeat(w.session_key, w.tid, 1, w.exp_ms)
        await loop.sock_sendall(self.sock, masked_binary(p.encode(beat)))
        ack = p.decode(await read_frame(self.sock, bytearray()))
        if not isinstance(ack, p.HeartbeatAck) or ack.seq != 1:
            raise ConnectionError(f"not the ACK of seq 1: {ack}")


async def open_clients(port: int, tokens: TokenService, count: int) -> list[Client]:
    clients: list[Client] = []
    for start in range(0, count, OPEN_AT_ONCE):
        clients += await asyncio.gather(
            *(
                Client.open(port, tokens.mint(f"h{n}", ttl_s=3600))
                for n in range(start, min(count, start + OPEN_AT_ONCE))
            )
        )
    return clients


async def hand_over(old: App, new: App) -> int:
    """Every connection of ``old`` handed to ``new``: how many moved."""
    assert old.admission is not None and new.admission is not None
    give, take = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    give.setblocking(False)
    taking = Taker(new.admission, new.node, take, lambda: True).start()
    report = await Giver(old.admission.connections, old.node, give, new.node.name).run()
    await taking  # its last batch adopted
    if report.fell_back:
        raise RuntimeError(f"connections fell back: {dict(report.fell_back)}")
    return report.moved


async def run(workdir: Path, connections: int, rounds: int, profile: bool) -> dict[str, Any]:
    redis = RedisProcess(workdir / "redis")
    redis.start()
    apps: list[App] = []
    logs.configure("json", "warning")
    try:
        for name in ("a", "b"):
            settings = config.load(
                {
                    **CLOCKS,
                    "redis_url": redis.url,
                    "keys_dir": str(workdir / "keys"),
                    "data_dir": str(workdir / name),
                    "node_name": name,
                    "host": LOOPBACK,
                    "port": 0,
                    "admin_port": -1,
                    "max_connections_per_ip": 0,
                    "log_level": "warning",
                },
                environ={},
            )
            app = App(settings)
            await app.start()
            apps.append(app)
        tokens = TokenService(apps[0].settings, KeyRing.open(apps[0].settings.resolved_keys_dir))
        clients = await open_clients(apps[0].port, tokens, connections)
        # What was made so far is never collected: a full collection would fall in one
        # run's rounds and not in the other's.
        gc.collect()
        gc.freeze()
        profiler = cProfile.Profile() if profile else None
        moved = 0
        cpu = 0.0
        for r in range(rounds):
            old, new = apps[r % 2], apps[1 - r % 2]
            began = time.process_time()
            if profiler is not None:
                profiler.enable()
            moved += await hand_over(old, new)
            if profiler is not None:
                profiler.disable()
            cpu += time.process_time() - began
        for start in range(0, connections, OPEN_AT_ONCE):
            await asyncio.gather(*(c.heartbeat() for c in clients[start : start + OPEN_AT_ONCE]))
        for client in clients:
            client.sock.close()
        figures: dict[str, Any] = {"moved": moved, "cpu_us": cpu / moved * 1e6 if moved else 0}
        if profiler is not None:
            figures["profile"] = profiler
        return figures
    finally:
        for app in apps:
            await app.stop()
        redis.stop()


def in_process(connections: int, rounds: int, profile: bool) -> dict[str, Any]:
    if 2 * connections + 1000 > fd_limit():
        raise SystemExit(f"{connections} connections need a higher open-file limit")
    with tempfile.TemporaryDirectory(prefix="tokend-handoff-") as workdir:
        return uvloop.run(run(Path(workdir), connections, rounds, profile))


def callgrind(connections: int, rounds: int, keep: Path | None) -> dict[str, Any]:
    """Instructions per moved connection: two runs under callgrind, the second with twice
    the rounds (``keep``: the directory to keep their callgrind files in)."""
    counts = []
    for measured in (rounds, 2 * rounds):
        out = keep / f"callgrind.{measured}" if keep is not None else Path(os.devnull)
        module_args = ["bench.handoff_profile", "--connections", str(connections)]
        counts.append(
            callgrind_instructions([*module_args, "--rounds", str(measured), "--quiet"], out)
        )
    return {"instructions": counts, "per_move": (counts[1] - counts[0]) / (rounds * connections)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6, help="handoffs, back and forth")
    parser.add_argument("--cprofile", action="store_true", help="calls, top functions")
    parser.add_argument("--callgrind", action="store_true", help="instructions per move")
    parser.add_argument("--keep", type=Path, help="--callgrind: keep its files in this directory")
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # callgrind's
    args = parser.parse_args()
    if args.callgrind:
        figures = callgrind(args.connections, args.rounds, args.keep)
        print(
            f"{figures['per_move']:,.0f} instructions per moved connection "
            f"({args.connections} connections, {args.rounds} rounds more in the second run; "
            f"totals {figures['instructions'][0]:,} and {figures['instructions'][1]:,})"
        )
        return
    figures = in_process(args.connections, args.rounds, args.cprofile)
    if args.quiet:
        return
    print(
        f"{figures['cpu_us']:.1f} us CPU per moved connection, old and new worker "
        f"(process_time; {figures['moved']:,} moved in {args.rounds} rounds)"
    )
    profiler = figures.get("profile")
    if profiler is not None:
        print_profile(profiler, figures["moved"], "moved connection", 30)


if __name__ == "__main__":
    main()
