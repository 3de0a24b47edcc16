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

from testkit.net import LOOPBACK

RUN = Path(__file__).resolve().parent.parent / "load_tests" / "run.py"
SOAK = RUN.with_name("soak.py")
OVERLOAD = RUN.with_name("overload.py")


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


def run_json(script: Path, tmp_path: Path, *args: str, timeout: float) -> dict:
    """Run a load script with ``args`` and ``--json``; its figures (it must have stopped
    everything it started)."""
    figures_file = tmp_path / "figures.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKEND_")}
    result = subprocess.run(
        [sys.executable, str(script), *args, "--json", str(figures_file)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert figures_file.exists(), result.stdout + result.stderr
    figures = json.loads(figures_file.read_text())
    figures["returncode"], figures["stdout"] = result.returncode, result.stdout
    assert not Path(figures["workdir"]).exists()
    assert not _processes_mentioning(figures["workdir"])
    return figures


def test_soak_smoke_run(tmp_path: Path):
    """load_tests/soak.py, tiny: 60 sessions from 2 processes, 0.5 s heartbeats for 3 s."""
    figures = run_json(
        SOAK, tmp_path, "--sessions", "60", "--per-client", "30", "--duration", "3",
        "--heartbeat", "0.5", timeout=60,
    )  # fmt: skip
    assert figures["returncode"] == 0, figures["stdout"]
    assert figures["stdout"].rstrip().endswith("result:             PASS")
    hold = figures["hold"]
    assert figures["open"]["opened"] == hold["sessions"] == 60 and hold["closes"] == {}
    # Each session heartbeated from its own WELCOME, not from the end of the open.
    opened = figures["open"]
    assert opened["heartbeats_sent"] >= 60
    assert opened["lost_after_welcome"] == {} and opened["events"] == {"SESSION_STARTED": 60}
    # Every connection heartbeated about six times, each ACKed and timed.
    assert hold["acks"] == hold["sent"] >= 60 * 5
    assert hold["ack_latency"]["samples"] == hold["acks"]
    assert hold["rss_mb"]["tokend"] > 0 and hold["rss_mb"]["redis"] > 0
    assert hold["events"] == {}


def test_soak_restart_and_expire_smoke_run(tmp_path: Path):
    """The capacity phases, tiny: 2 workers restarted under 60 sessions, which resume;
    then every client is SIGKILLed and each session warns and expires once.

    A session survives the restart if its client is back within expire_after (4
    heartbeats) of its last heartbeat: silence before SIGTERM, drain, start, and the
    SDK's doubling backoff through the downtime. 8 s heartbeats leave 32 s for that; 3 s
    (12 s) was outlived by a few clients on a machine with both cores busy, and 5 s
    (20 s) by one once the workers became fresh interpreters (their start takes a
    second or two longer than a fork's there)."""
    figures = run_json(
        SOAK, tmp_path, "--sessions", "60", "--per-client", "20", "--workers", "2",
        "--duration", "2", "--heartbeat", "8", "--drain-period", "0.5", "--restart",
        "--restart-window", "20", "--expire", timeout=180,
    )  # fmt: skip
    assert figures["returncode"] == 0, figures["stdout"]
    assert figures["client_processes"] == 3
    assert set(figures["hold"]["cpu_pct"]) >= {"supervisor", "worker-1", "worker-2", "redis"}
    # How long each waited for a CPU: the hold's processes, then the restarted ones.
    waits = {"worker-1", "worker-2", "redis", "clients (mean)"}
    assert set(figures["hold"]["cpu_wait_pct"]) == waits
    assert set(figures["restart"]["cpu_wait_pct"]) == waits
    assert all(0 <= share <= 100 for share in figures["restart"]["cpu_wait_pct"].values())
    restart = figures["restart"]
    assert restart["supervisor_exit"] == 0 and restart["closes"] == {"1001": 60}
    assert restart["resumed"] == 60 and restart["started_anew"] == 0
    assert "TOKEN_EXPIRED" not in restart["events"]
    expire = figures["expire"]
    assert expire["warned_once"] == expire["expired_once"] == 60


def test_soak_reload_smoke_run(tmp_path: Path):
    """The rolling reload under load, tiny: 2 workers replaced one at a time under 300
    sessions, each handed to its slot's new worker: no client closed, none resumed."""
    figures = run_json(
        SOAK, tmp_path, "--sessions", "300", "--per-client", "150", "--workers", "2",
        "--duration", "2", "--heartbeat", "5", "--reload-drain-period", "1", "--reload",
        "--reload-window", "15", timeout=120,
    )  # fmt: skip
    assert figures["returncode"] == 0, figures["stdout"]
    reloaded = figures["reload"]
    assert reloaded["result"] == "ok" and reloaded["nodes"] == ["bench-w1.2", "bench-w2.2"]
    assert sum(reloaded["connections_per_worker"]) == 300
    assert (reloaded["moved"], reloaded["fell_back"]) == (300, {})
    assert sum(h["moved"] for h in reloaded["handoffs"].values()) == 300
    assert reloaded["closes"] == {} and reloaded["resumed"] == 0
    assert reloaded["acks"] == reloaded["sent"] > 0
    assert reloaded["live_at_end"] == 300 and reloaded["started_anew"] == 0
    assert reloaded["refused_connects"] == 0 and reloaded["events"] == {}
    assert set(reloaded["old_workers_exited_after_signal_s"]) == {"bench-w1", "bench-w2"}
    assert reloaded["cpu_per_moved_us"] > 0
    # The machine's CPU over the reload, the load generators' part of it measured apart.
    cpu = reloaded["cpu_pct"]
    assert cpu["machine"] >= cpu["clients (all)"] > 0
    # The waits for a CPU of the new workers (their life in the reload) and the clients'.
    assert set(reloaded["cpu_wait_pct"]) == {"worker-1", "worker-2", "redis", "clients (mean)"}
    assert "latency goals:" in figures["stdout"] and "per moved connection" in figures["stdout"]


def test_soak_tls_reload_smoke_run(tmp_path: Path):
    """The same over wss:// served by tokend itself: no TLS connection can be handed
    over, each falls back to 1001 and resumes; none is lost."""
    figures = run_json(
        SOAK, tmp_path, "--sessions", "60", "--per-client", "30", "--workers", "2",
        "--duration", "2", "--heartbeat", "5", "--reload-drain-period", "1", "--reload",
        "--reload-window", "15", "--tls", timeout=120,
    )  # fmt: skip
    assert figures["returncode"] == 0, figures["stdout"]
    reloaded = figures["reload"]
    assert (reloaded["moved"], reloaded["fell_back"]) == (0, {"tls": 60})
    assert reloaded["closes"] == {"1001": 60} and reloaded["resumed"] == 60
    assert reloaded["live_at_end"] == 60 and "TOKEN_EXPIRED" not in reloaded["events"]


def test_overload_smoke_run(tmp_path: Path):
    """load_tests/overload.py, tiny: the groups, the phases, the report. Whether this
    small load overloads the node depends on the machine; the highest prio is never
    shed either way."""
    figures = run_json(
        OVERLOAD, tmp_path, "--sessions", "300", "--heartbeat", "3", "--overload-for", "4",
        "--recovery", "8", timeout=120,
    )  # fmt: skip
    assert figures["sizes"]["high"] == 60
    for window in ("baseline", "overload", "recovery"):
        high = figures[window]["high"]
        assert high["acks"] == high["sent"] > 0 and high["closes"] == {}
    assert figures["overload"]["high"]["refusals"] == {}
    flood = figures["overload"]["low-flood"]
    assert flood["sent"] > figures["baseline"]["low-flood"]["sent"]  # flooded
    # The done criterion: no flood client closed, what the flood cost each side.
    done = figures["done"]
    assert done["flood_closed"] == 0 and done["tokend_cpu_s"] > 0
    assert done["generator_cpu_s"] >= 0 and done["high_p99_ratio"] is not None
    assert {"storm-mid", "storm-low"} <= figures["overload"].keys()
    assert set(figures["cpu_wait_pct_overload"]) == set(figures["cpu_pct_overload"])
    # tokend's own CPU by 5 s, and the ACKs of the top group in the same buckets.
    node = figures["node_timeline"]
    assert [r["t"] for r in node] == list(range(0, 5 * len(node), 5)) and len(node) >= 2
    assert 0 < node[0]["on_cpu_pct"] <= 100 and 0 <= node[0]["waited_pct"] <= 100
    assert sum(r["acks"] for r in figures["overload"]["high"]["timeline"]) > 0
