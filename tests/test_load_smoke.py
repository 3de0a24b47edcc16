"""The load test, small: load_tests/run.py with 20 users for 5 s, so that it cannot rot.

It runs the real thing: ``tokend serve`` on the embedded default, tokens from
``tokend issue``, locust headless with ``load_tests/locustfile.py``. Short
clocks (0.5 s heartbeats, 3 s tokens renewed 2 s before their exp) make five
seconds exercise renewal, with 2 s (expire_after) of slack for a busy machine.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.support import LOOPBACK

RUN = Path(__file__).resolve().parent.parent / "load_tests" / "run.py"
SOAK = RUN.with_name("soak.py")


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found


def test_locust_smoke_run(tmp_path: Path):
    out = tmp_path / "load"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKEND_")}
    result = subprocess.run(
        [sys.executable, str(RUN), "--users", "20", "--duration", "5",
         "--heartbeat", "0.5", "--ttl", "3", "--renew-window", "2", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr

    with (out / "locust_stats.csv").open() as fh:
        rows = {row["Name"]: row for row in csv.DictReader(fh)}
    assert int(rows["connect+hello"]["Request Count"]) == 20
    assert int(rows["heartbeat"]["Request Count"]) > 0
    assert int(rows["renewal"]["Request Count"]) > 0
    assert {name: int(row["Failure Count"]) for name, row in rows.items()} == dict.fromkeys(rows, 0)

    summary = (out / "summary.txt").read_text()
    assert result.stdout == summary
    assert summary.rstrip().endswith("result:        PASS")
    assert "failures:      0 (none)" in summary
    assert "TOKEN_EXPIRED" not in summary and "SESSION_WARN" not in summary

    # It stopped everything it started: the server, its embedded Redis, the temp dir.
    server_line = next(line for line in summary.splitlines() if line.startswith("server:"))
    port = int(server_line.split(f"{LOOPBACK}:")[1].split()[0])
    workdir = server_line.split("; ")[1].removesuffix(" removed")
    assert "stopped on SIGTERM" in server_line
    assert not Path(workdir).exists()
    assert not _processes_mentioning(workdir)
    with socket.socket() as probe:
        assert probe.connect_ex((LOOPBACK, port)) != 0


def test_soak_smoke_run(tmp_path: Path):
    """load_tests/soak.py, tiny: 60 sessions from 2 processes, 0.5 s heartbeats for 3 s."""
    figures_file = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKEND_")}
    result = subprocess.run(
        [sys.executable, str(SOAK), "--sessions", "60", "--clients", "2", "--duration", "3",
         "--heartbeat", "0.5", "--json", str(figures_file)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("result:             PASS")
    figures = json.loads(figures_file.read_text())
    assert figures["sessions"] == 60 and figures["unexpected_closes"] == {}
    # Every connection heartbeated about six times, each ACKed and timed.
    assert figures["acks"] == figures["heartbeats_sent"] >= 60 * 5
    assert figures["ack_latency"]["samples"] == figures["acks"]
    assert figures["server_rss_mb"]["peak"] > 0
    assert figures["events"] == {"SESSION_STARTED": 60}
    # It stopped everything it started.
    assert not Path(figures["workdir"]).exists()
    assert not _processes_mentioning(figures["workdir"])
