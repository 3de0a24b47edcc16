"""``tokend serve``: run the server, one process or a supervisor of workers."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from tokend import config
from tokend.cli.common import run_async
from tokend.config import Settings
from tokend.core.lifecycle import resume_outlasted

# The settings `tokend serve` reads; its --help shows these alone.
SETTINGS: tuple[str, ...] = tuple(config.FIELDS)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve",
        help="run the server",
        description="Serve /v1/ws, /healthz, /readyz and /.well-known/jwks.json, and on the "
        "admin port /metrics, the admin API and the dashboard (docs/operations.md). With no "
        "Redis URL, starts a private redis-server under the data dir and stops it on exit. "
        "SIGTERM drains (1001 spread over drain_period); a second signal exits at once. "
        "With --workers N, a supervisor holds the port and runs N processes on it (worker i "
        "on admin port + i - 1), replaces them one at a time on SIGHUP (tokend reload), and "
        "exits 1 when one of them dies. Sockets from systemd socket activation (LISTEN_FDS) "
        "are served as they are; NOTIFY_SOCKET hears READY=1.",
    )
    # A supervisor's worker (tokend/ops/supervisor.py): no pid file, no workers of its own.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def _exit_now() -> NoReturn:
    """End a worker that has stopped (its connections closed, Redis and logs flushed)
    without the interpreter's teardown: freeing a busy worker's objects one by one takes
    CPU in proportion to its connections, from the new workers of a reload that are
    resuming its sessions on the same cores."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker_environ(args: argparse.Namespace) -> dict[str, str]:
    """The environment a supervisor starts its workers with: its own, and the settings of
    its command line as TOKEND_* variables (above the config file, as flags are)."""
    environ = dict(os.environ)
    for name in config.FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            environ[config.env_name(name)] = str(value)
    if args.config:
        environ["TOKEND_CONFIG"] = args.config
    return environ


def run(settings: Settings, args: argparse.Namespace) -> int:
    from tokend.ops.app import serve_until_signalled
    from tokend.ops.pidfile import AlreadyRunning, PidFile

    if args.worker:  # started by a supervisor, which holds the pid file
        run_async(serve_until_signalled(settings, worker=True))
        _exit_now()
    if resume_outlasted(settings.ms("heartbeat_interval"), settings.ms("expire_after")):
        import structlog

        structlog.get_logger("tokend.cli").warning(
            "expire_after does not outlast a lost connection's hold",
            heartbeat_interval=settings.heartbeat_interval,
            expire_after=settings.expire_after,
            reason="a client whose connection went away unseen is refused (4509) for "
            "heartbeat_interval + 15 s without its resume proof, and its session may "
            "expire meanwhile: make expire_after longer than that",
        )
    if settings.workers > 1:
        from tokend.ops.supervisor import supervise

        try:
            return supervise(settings, _worker_environ(args))
        except AlreadyRunning as exc:
            print(f"tokend serve: {exc}", file=sys.stderr)
            return 1
    pidfile = PidFile(settings.resolved_data_dir)
    try:
        pidfile.acquire(patience=0)
    except (AlreadyRunning, OSError) as exc:
        # Single nodes may share a data directory, or have none they may write (a
        # Redis URL and a keys directory of their own): tokend reload finds the first.
        import structlog

        structlog.get_logger("tokend.cli").warning("no pid file written", reason=str(exc))
    pidfile.write_status({"workers": 1, "state": "serving"})
    try:
        run_async(serve_until_signalled(settings))
    finally:
        pidfile.release()
    return 0
