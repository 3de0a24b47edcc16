"""``tokend reload``: SIGHUP to the supervisor on the data directory, and its outcome."""

from __future__ import annotations

import argparse
import os
import sys

from tokend.cli.common import LOGS
from tokend.config import Settings

# The settings `tokend reload` reads; its --help shows these alone.
SETTINGS: tuple[str, ...] = ("data_dir", *LOGS)
# How long it waits for the reload by default, and how often it looks.
RELOAD_TIMEOUT_S = 600.0
RELOAD_POLL_S = 0.1


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "reload",
        help="replace the workers of a running supervisor, one at a time",
        description="Find the server on the data directory (its tokend.pid), send it SIGHUP "
        "and wait until the rolling reload has finished: every worker replaced by a new "
        "process started from the code and config file as they are now, without closing "
        "the port (docs/operations.md). Exit status 0 when it succeeded; 1 with a one-line "
        "reason when no server runs, it is a single process, the reload failed (the old "
        "workers keep serving) or it took longer than --timeout.",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=RELOAD_TIMEOUT_S,
        help=f"seconds to wait for the outcome (default {RELOAD_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--no-wait", action="store_true", help="send SIGHUP and return without waiting"
    )
    parser.set_defaults(func=run)


def run(settings: Settings, args: argparse.Namespace) -> int:
    """SIGHUP to the supervisor on the data directory; wait for the reload's outcome."""
    import signal
    import time

    from tokend.ops import pidfile

    data_dir = settings.resolved_data_dir

    def fail(message: str) -> int:
        print(f"tokend reload: {message}", file=sys.stderr)
        return 1

    try:
        pid = pidfile.running(data_dir)
    except pidfile.NoServer as exc:
        return fail(str(exc))
    status = pidfile.read_status(data_dir)
    if not status or status.get("state") in ("starting", "stopping"):
        state = status.get("state", "starting")
        return fail(f"the server (pid {pid}) is {state}; try again once it serves")
    if status["workers"] == 1:
        return fail(
            f"the server (pid {pid}) is one process, which cannot replace itself: run it "
            "under a supervisor (--workers), or restart it under socket activation "
            "(docs/operations.md)"
        )
    asked = status.get("reloads_requested", 0)
    os.kill(pid, signal.SIGHUP)
    if args.no_wait:
        print(f"tokend reload: SIGHUP sent to {pid}")
        return 0
    deadline = time.monotonic() + args.timeout
    # A reload answers this request once it has begun after it (reloads_done counts
    # the requests a finished reload had received when it began).
    while status.get("reloads_done", 0) <= asked:
        if time.monotonic() >= deadline:
            return fail(f"no outcome within {args.timeout:g} s; the reload goes on (pid {pid})")
        time.sleep(RELOAD_POLL_S)
        try:
            pidfile.running(data_dir)
        except pidfile.NoServer:
            return fail(f"the server (pid {pid}) exited during the reload")
        status = pidfile.read_status(data_dir)
    last = status["last_reload"]
    if last["result"] != "ok":
        return fail(f"reload failed after {last['seconds']:g} s: {last['reason']}")
    print(
        f"tokend reload: reloaded in {last['seconds']:g} s, generation "
        f"{last['generation']}: {', '.join(status['nodes'])}"
    )
    return 0
