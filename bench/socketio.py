"""Scenario 6, the peer users would otherwise pick: Socket.IO 4 on Node.

The harness installs ``socket.io@4`` and ``socket.io-client@4`` from the npm registry
into ``$XDG_CACHE_HOME/tokend-bench/node`` (``~/.cache/...`` by default), starts
``socketio_server.js`` (websocket transport only, no per-message deflate) as its own
process, checks it with one emit-with-ack through the official client, then measures
it like tokend in scenarios 1 and 2, with the same picows load generator speaking
engine.io v4 / Socket.IO v5: the handshake, OPEN, namespace CONNECT, then
``42<id>["hb","<heartbeat, base64>"]`` acknowledged by ``43<id>["<20-byte ACK>"]``,
one text frame each way (a Buffer payload would cost Socket.IO two frames each way).

Without node or npm, or when the install fails, the scenario is skipped with a row
that says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from bench import heartbeat, idle_memory
from bench.common import BenchError, Child, Context, Row, child, ratio
from testkit.net import free_port

PACKAGES = ("socket.io", "socket.io-client")
MAJOR = "4"
HERE = Path(__file__).resolve().parent
INSTALL_TIMEOUT_S = 300


def install_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tokend-bench" / "node"


def installed(directory: Path) -> bool:
    for name in PACKAGES:
        manifest = directory / "node_modules" / name / "package.json"
        if not manifest.is_file():
            return False
        if not json.loads(manifest.read_text())["version"].startswith(MAJOR + "."):
            return False
    return True


def install() -> str | None:
    """Install the npm packages if needed; None when ready, else why not."""
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        return "skipped: node or npm not found"
    directory = install_dir()
    if installed(directory):
        return None
    directory.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            [
                npm,
                "install",
                "--prefix",
                str(directory),
                "--no-audit",
                "--no-fund",
                *(f"{name}@{MAJOR}" for name in PACKAGES),
            ],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"skipped: npm install took over {INSTALL_TIMEOUT_S} s"
    if done.returncode or not installed(directory):
        return f"skipped: npm install failed: {(done.stderr or done.stdout).strip()[-300:]}"
    return None


def node_env() -> dict[str, str]:
    return {**os.environ, "NODE_PATH": str(install_dir() / "node_modules")}


@contextlib.contextmanager
def socketio_server(ctx: Context) -> Iterator[Child]:
    port = free_port()
    node = shutil.which("node") or "node"
    argv = [node, str(HERE / "socketio_server.js"), str(port)]
    log = ctx.scratch("socketio") / "socketio.log"
    with child(
        "socketio", argv, log, port=port, ready="listening", cpus=ctx.server_cpus, env=node_env()
    ) as server:
        check = subprocess.run(
            [node, str(HERE / "socketio_check.js"), str(port)],
            capture_output=True,
            text=True,
            timeout=30,
            env=node_env(),
        )
        if check.returncode:
            raise BenchError(f"socket.io check failed: {check.stdout}{check.stderr}")
        yield server


def url(server: Child) -> str:
    return f"ws://127.0.0.1:{server.port}/socket.io/?EIO=4&transport=websocket"


async def run(ctx: Context) -> list[Row]:
    problem = await asyncio.to_thread(install)
    if problem:
        return [Row("socket.io", "not measured", None, "", "beat Socket.IO", None, note=problem)]
    with socketio_server(ctx) as server:
        peer = await heartbeat.roundtrip(
            ctx, "socketio", url(server), "socketio", {"socketio": server.pid}
        )
    tokend = await heartbeat.tokend_figures(ctx)
    rate_ratio = ratio(tokend["rate"], peer["rate"])
    rows = [
        Row(
            "vs socket.io",
            f"acked round trips/s, {ctx.sizes.connections} conns",
            tokend["rate"],
            "/s",
            "> 1x socket.io",
            rate_ratio is not None and rate_ratio > 1,
            "socket.io",
            peer["rate"],
            rate_ratio,
            heartbeat.describe("tokend", tokend) + " | " + heartbeat.describe("socket.io", peer),
            {"tokend": tokend, "socketio": peer},
        )
    ]
    for sessions in ctx.sizes.idle_sessions:
        with socketio_server(ctx) as server:
            idle = await idle_memory.hold(
                ctx, "socketio", url(server), "socketio", server.rss, sessions
            )
        mine = await idle_memory.tokend_figures(ctx, sessions)
        mem_ratio = ratio(mine["rss_per_session"], idle["rss_per_session"])
        rows.append(
            Row(
                "vs socket.io",
                f"server RSS/conn, {sessions:,} idle",
                mine["rss_per_session"],
                "B",
                "< 1x socket.io",
                mem_ratio is not None and mem_ratio < 1,
                "socket.io",
                idle["rss_per_session"],
                mem_ratio,
                f"socket.io RSS {idle['rss_before'] / 2**20:.1f} -> "
                f"{idle['rss_after'] / 2**20:.1f} MiB",
                {"tokend": mine, "socketio": idle},
            )
        )
    return rows
