"""The benchmark harness still runs: one tiny ``python -m bench --quick``, no npm.

Real benchmark numbers come from ``python -m bench`` (docs/performance.md); this only
keeps the harness from rotting. It needs the ``bench`` extra (picows).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("picows", reason="the bench extra is not installed")

ROOT = Path(__file__).resolve().parent.parent


def run_bench(tmp_path: Path, *args: str, timeout: float) -> tuple[str, list[dict[str, Any]]]:
    """``python -m bench --quick ARGS``, tiny sizes: its output and its rows."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", *args, "--quick", f"--json={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(out.read_text())["rows"]


def test_quick_heartbeat_and_connect_storm(tmp_path: Path) -> None:
    stdout, rows = run_bench(
        tmp_path,
        "heartbeat",
        "connect",
        "--connections=10",
        "--warmup=0.3",
        "--duration=1",
        "--connects=60",
        "--clients=1",
        timeout=90,
    )
    assert [r["scenario"] for r in rows] == ["heartbeat"] * 3 + ["connect storm"]
    for row in rows:
        assert row["value"] > 0 and row["baseline"] > 0, row
        # Judged against a target, or (the Sans-I/O floor) reported only, with no ratio
        # when its rate is within half the client's ceiling.
        if row["target"] == "(reported)":
            assert row["met"] is None, row
            assert (row["ratio"] is None) == ("client-bound" in row["metric"]), row
        else:
            assert row["met"] in (True, False) and row["ratio"] > 0, row
    assert "| heartbeat " in stdout and "| connect storm " in stdout
    # The closed loop's heartbeats were built before it, and tokend took them.
    loops = rows[0]["details"]
    assert {name: loops[name]["built_live"] for name in loops} == dict.fromkeys(loops, 0)


def test_quick_tls(tmp_path: Path) -> None:
    """The TLS scenario: every server over wss:// with the run's certificate, verified
    by the clients, beside the same over plain TCP."""
    stdout, rows = run_bench(
        tmp_path,
        "tls",
        "--connections=10",
        "--warmup=0.3",
        "--duration=1",
        "--connects=40",
        "--clients=1",
        timeout=120,
    )
    assert [r["baseline_name"] for r in rows] == ["tokend plain", "bare TLS", "bare plain"] * 2
    for row in rows:
        assert row["value"] > 0 and row["baseline"] > 0 and row["met"] is None, row
    assert "clients' ceiling (picows server) TLS" in stdout


def test_resume_counts_the_servers_connections_only() -> None:
    """bench resume waits for the server to close every dropped connection: a socket of
    another loopback address on the server's port (a load generator's, from 127.0.0.2)
    is not one of them (it kept `bench resume` waiting 120 s, then failing)."""
    from bench.resume import server_connections
    from testkit.net import LOOPBACK

    with contextlib.ExitStack() as sockets:
        elsewhere = sockets.enter_context(socket.socket())
        elsewhere.bind((LOOPBACK, 0))
        elsewhere.listen()
        server, stranger = port_on_two_addresses(sockets, LOOPBACK, "127.0.0.2")
        server.listen()
        port = server.getsockname()[1]
        stranger.connect(elsewhere.getsockname())
        sockets.enter_context(elsewhere.accept()[0])
        assert server_connections(port) == 0
        sockets.enter_context(socket.create_connection((LOOPBACK, port)))
        sockets.enter_context(server.accept()[0])
        assert server_connections(port) == 1


def test_the_handoff_profile_moves_connections_back_and_forth() -> None:
    """``python -m bench.handoff_profile``, tiny: every connection moves each round, and
    each client's heartbeat after the last round is ACKed (the harness checks it)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.handoff_profile", "--connections=20", "--rounds=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "per moved connection" in done.stdout and "60 moved in 3 rounds" in done.stdout


def port_on_two_addresses(
    sockets: contextlib.ExitStack, first: str, second: str
) -> tuple[socket.socket, socket.socket]:
    """Two sockets bound to one port, one on each address (a port the second address
    already uses, as a busy machine's load generators may, is skipped)."""
    while True:
        one = sockets.enter_context(socket.socket())
        one.bind((first, 0))
        two = sockets.enter_context(socket.socket())
        try:
            two.bind((second, one.getsockname()[1]))
        except OSError:
            continue
        return one, two
