"""``tokend serve --workers N``: N node processes on one port under one supervisor.

The supervisor is the process the operator started. It starts the embedded
redis-server when no Redis URL is set, so that every worker shares one store,
then forks N workers. Each worker is a whole node (issue 5: any node accepts any
session) named ``<node_name>-w<i>``, with its own sweeper and control
subscription, listening on the same port with SO_REUSEPORT so that the kernel
spreads new connections over them.

* SIGTERM or SIGINT to the supervisor is forwarded to every worker as SIGTERM;
  each stops gracefully (close 1001, sessions stay resumable). The supervisor
  waits for all of them, stops the embedded Redis and exits 0. A second signal
  meanwhile kills the workers still stopping (exit 1).
* A worker that dies on its own (or fails to start) is logged with its node
  name, pid and exit status; the supervisor stops the other workers the same way
  and exits 1. It does not restart it: a crash is a bug or a resource problem
  that a restart loop in here would hide. The service manager (systemd
  ``Restart=on-failure``, a compose restart policy) restarts the group, and the
  clients resume their sessions on any node.
* Workers die with the supervisor (PR_SET_PDEATHSIG), even if it is SIGKILLed.
* Worker ``i`` serves its admin listener (metrics, admin API) on ``admin_port + i - 1``.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.process import BaseProcess

import structlog

from tokend.config import Settings
from tokend.embedded import EmbeddedRedis, die_with_parent

log = structlog.get_logger("tokend.workers")

# Blocked in the supervisor and taken with sigwaitinfo: no handler races the loop.
_WATCHED = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}


def _worker_settings(settings: Settings, redis_url: str, index: int) -> Settings:
    # Each worker's metrics are its own, so each has its own admin port: the
    # configured one for the first worker, the next ones for the others (0: any free
    # port each, -1: off for all).
    admin_port = settings.admin_port + index - 1 if settings.admin_port > 0 else settings.admin_port
    return replace(
        settings,
        redis_url=redis_url,
        node_name=f"{settings.resolved_node_name}-w{index}",
        admin_port=admin_port,
    )


def _work(serve: Callable[[Settings], object], settings: Settings) -> None:
    """A worker's body, in the forked child."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _WATCHED)
    die_with_parent()
    try:
        serve(settings)
    except Exception:
        log.exception("worker failed", node=settings.node_name)
        raise SystemExit(1) from None


def supervise(settings: Settings, serve: Callable[[Settings], object]) -> int:
    """Run ``settings.workers`` workers, each calling ``serve``; the exit status."""
    embedded = None
    redis_url = settings.redis_url
    if not redis_url:
        embedded = EmbeddedRedis(settings.resolved_data_dir)
        embedded.start()
        redis_url = embedded.url
    # Fork, not spawn: a worker needs no re-import, and the supervisor has no
    # threads or event loop to carry over.
    context = multiprocessing.get_context("fork")
    signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    workers: list[BaseProcess] = []
    try:
        for index in range(1, settings.workers + 1):
            own = _worker_settings(settings, redis_url, index)
            worker = context.Process(target=_work, args=(serve, own), name=own.node_name)
            worker.start()
            workers.append(worker)
            log.info("worker started", node=own.node_name, pid=worker.pid)
        status = _wait_for_stop(workers)
        _stop(workers)
        for worker in workers:
            if worker.exitcode != 0 and status == 0:
                log.error("worker stopped uncleanly", node=worker.name, exitcode=worker.exitcode)
                status = 1
    finally:
        for worker in workers:
            if worker.is_alive():  # only if the supervisor itself failed
                worker.kill()
                worker.join()
        if embedded is not None:
            embedded.stop()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WATCHED)
    log.info("workers stopped", status=status)
    return status


def _wait_for_stop(workers: list[BaseProcess]) -> int:
    """Block until a stop signal (0) or a worker's death (1)."""
    while True:
        received = signal.sigwaitinfo(_WATCHED)
        if received.si_signo != signal.SIGCHLD:
            log.info(
                "signal received, stopping workers", signal=signal.Signals(received.si_signo).name
            )
            return 0
        dead = [worker for worker in workers if not worker.is_alive()]
        if dead:  # a SIGCHLD may also come from the embedded Redis
            for worker in dead:
                log.error("worker died", node=worker.name, pid=worker.pid, exitcode=worker.exitcode)
            return 1


def _stop(workers: list[BaseProcess]) -> None:
    """SIGTERM every live worker (a graceful stop) and wait for all of them; another
    SIGTERM or SIGINT meanwhile kills those still stopping."""
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    while alive := [worker for worker in workers if worker.is_alive()]:
        # A worker exiting after the check leaves its SIGCHLD pending: no lost wake-up.
        if signal.sigwaitinfo(_WATCHED).si_signo != signal.SIGCHLD:
            log.warning("signal received again, killing workers", nodes=[w.name for w in alive])
            for worker in alive:
                worker.kill()
