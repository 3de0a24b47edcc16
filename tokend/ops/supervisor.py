"""``tokend serve --workers N``: N node processes on one port under one supervisor, and
their rolling reload.

The supervisor is the process the operator started. It binds the listening sockets
once, one SO_REUSEPORT socket per worker *slot* on the port (and one admin socket per
slot), starts the embedded redis-server when no Redis URL is set, and starts in each slot
a worker: ``python -m tokend serve --worker``, a fresh interpreter, which inherits its
slot's sockets by systemd's socket-activation convention (tokend/ops/activation.py) and
reports ``READY=1`` on the supervisor's notification socket once it listens and its node
is subscribed. Each worker is a whole node (any node accepts any session) named
``<node_name>-w<i>``, then ``<node_name>-w<i>.<g>`` for the generation g a reload starts
(2, 3, ...): two processes of a slot live at once during a reload, and a node's name
must be its own (connection ids ``<node>/<n>``, control channel ``ctl:<node>``).

The sockets live in the supervisor, not in the workers: a worker that stops closes only
its copy, so connections wait in the backlog for the slot's next worker (or go to the
other slots) and are never refused. The kernel spreads new connections evenly over the
slots' sockets (SO_REUSEPORT hashes the connection's addresses); the spread is kept
across reloads because the sockets are (docs/operations.md, "Restarts that keep the
port open").

* SIGHUP (``tokend reload``) replaces the workers (:meth:`Supervisor._reload`). The new
  workers start together; slot by slot, once the slot's new worker is ready (within
  :data:`WORKER_READY_TIMEOUT`) and fewer than :data:`HANDOFFS_AT_ONCE` slots are
  handing over, the old one stops accepting (SIGUSR1) and hands it its live
  connections over a socketpair made for the two (tokend/server/handoff.py). Then
  the old ones are sent SIGTERM together and close, with 1001, what they could not hand
  over (spread over their share of ``reload_drain_period``; their clients resume on the
  new workers), the same everywhere, with no gap between one old worker's last close
  and the next one's first. A new worker that exits or is not ready in time is killed,
  its slot's old one kept, the reload ended there and logged (``reload finished``,
  result ``failed``); the supervisor keeps serving. A SIGHUP during a reload is logged
  and answered by one more reload after it. The outcome goes to ``tokend.status``
  (tokend/ops/pidfile.py).
* SIGTERM or SIGINT is forwarded to every worker as SIGTERM, and the supervisor closes
  its copies of the sockets, so the port closes as it did before: each worker stops
  gracefully (close 1001, sessions stay resumable). The supervisor waits for all of them,
  stops the embedded Redis and exits 0. A second signal meanwhile kills the workers still
  stopping (exit 1).
* A worker that dies on its own (or fails to start) is logged with its node name, pid
  and exit status; the supervisor stops the other workers the same way and exits 1. It
  does not restart it: a crash is a bug or a resource problem that a restart loop in here
  would hide. The service manager (systemd ``Restart=on-failure``, a compose restart
  policy) restarts the group, and the clients resume their sessions on any node.
* Workers die with the supervisor (PR_SET_PDEATHSIG), even if it is SIGKILLed.
* The supervisor tells systemd (``Type=notify``) ``READY=1`` once every worker is
  ready, ``RELOADING=1`` and ``READY=1`` around a reload, ``STOPPING=1`` at a stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any

import structlog

from tokend.config import ConfigError, Settings
from tokend.ops import activation
from tokend.ops.embedded import EmbeddedRedis
from tokend.ops.pidfile import PidFile

log = structlog.get_logger("tokend.workers")

# From a new worker's start to its READY=1: an interpreter, the keys, Redis, the
# control subscription, slow under load. Beyond it the reload fails.
WORKER_READY_TIMEOUT = 30.0
# An old worker is killed if it has not closed its connections within DRAIN_SLACK x
# reload_drain_period + DRAIN_MARGIN. A drain ends by itself (each batch's closing
# handshakes are bounded), so it is late only when starved of CPU, and killing it then
# drops every client it has not closed yet, unparked: the slack lets a slow drain end.
DRAIN_SLACK = 3
DRAIN_MARGIN = 15.0
# After it has closed its connections: how long an old worker may take to exit.
EXIT_TIMEOUT = 10.0
# An old worker's handoff, at most, before its drain begins all the same: each batch's
# reply is bounded (tokend.server.handoff.REPLY_TIMEOUT_S), so only a starved machine
# takes this long.
HANDOFF_TIMEOUT = 120.0
# Slots whose old worker hands its connections over at once: the handoffs of more, on a
# machine of few cores, compete with each other and with every worker's heartbeats.
HANDOFFS_AT_ONCE = 2
MAIN = "tokend"  # LISTEN_FDNAMES name of a worker's WebSocket listener
WORKER_COMMAND = (sys.executable, "-m", "tokend", "serve", "--worker")


def worker_name(node_name: str, slot: int, generation: int) -> str:
    """The node name of slot ``slot``'s worker of generation ``generation`` (1 at start)."""
    name = f"{node_name}-w{slot}"
    return name if generation == 1 else f"{name}.{generation}"


def bind(host: str, port: int, backlog: int, *, reuse_port: bool) -> socket.socket:
    """A listening TCP socket on the first address ``host`` resolves to (as asyncio
    binds it: SO_REUSEADDR, IPv6 sockets IPv6 only)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class Worker:
    """One worker process: its slot, name, and what it has reported."""

    def __init__(
        self,
        slot: Slot,
        name: str,
        process: subprocess.Popen[bytes],
        channel: socket.socket,
    ) -> None:
        self.slot = slot
        self.name = name
        self.process = process
        # The supervisor's end of the socketpair made for this worker (activation.SUPERVISOR).
        self.channel = channel
        self.handing = False  # handing its connections to the slot's new worker
        self.handed = asyncio.Event()  # its handoff ended (reported, or it exited)
        self.report: dict[str, Any] | None = None  # what its handoff moved and left
        self.ready = asyncio.Event()  # READY=1: listening, node started and subscribed
        self.drained = asyncio.Event()  # its drain has closed every connection
        self.exited = asyncio.Event()
        self.superseded = False  # a reload's new worker serves its slot: its exit is expected
        self.terminated = False  # sent SIGTERM: it drains and stops

    def terminate(self) -> None:
        """SIGTERM, once: a second one would hurry its drain."""
        if not self.terminated:
            self.terminated = True
            self.process.terminate()

    @property
    def pid(self) -> int:
        return self.process.pid


class Slot:
    """A place for one worker: its listening sockets, kept across reloads."""

    def __init__(self, index: int, listener: socket.socket, admin: socket.socket | None) -> None:
        self.index = index
        self.listener = listener
        self.admin = admin
        self.worker: Worker | None = None  # its live worker
        # The old worker handing its connections to the live one, until it reported.
        self.handing_from: Worker | None = None

    def sockets(self) -> list[tuple[socket.socket, str]]:
        named = [(self.listener, MAIN)]
        return named if self.admin is None else [*named, (self.admin, activation.ADMIN)]

    def close(self) -> None:
        self.listener.close()
        if self.admin is not None:
            self.admin.close()


class Supervisor:
    """The supervisor of ``settings.workers`` workers (see the module's docstring)."""

    def __init__(
        self,
        settings: Settings,
        environ: Mapping[str, str],
        redis_url: str,
        pidfile: PidFile,
        notifier: activation.Notifier,
    ) -> None:
        self.settings = settings
        self.node_name = settings.resolved_node_name
        self.environ = environ
        self.redis_url = redis_url
        self.pidfile = pidfile
        self.notifier = notifier
        self.slots: list[Slot] = []
        try:
            for index in range(1, settings.workers + 1):
                self.slots.append(self._bind_slot(index))
        except BaseException:
            for slot in self.slots:
                slot.close()
            raise
        self.notify_address = f"@tokend/{os.getpid()}/{secrets.token_hex(8)}"
        self.notify_socket = activation.notify_listener(self.notify_address)
        self.processes: dict[int, Worker] = {}  # every worker not yet exited, by pid
        self.generation = 1
        self.stopping = asyncio.Event()  # SIGTERM or SIGINT (or a worker's death)
        self.killed = False  # a second signal killed the workers
        self.death = asyncio.Event()  # a live worker died on its own
        self.reload_wanted = asyncio.Event()
        self.reloading = False
        self.requested = 0  # SIGHUPs received
        self.done = 0  # requests answered by a finished reload
        self.last_reload: dict[str, Any] | None = None
        # A reload's new worker that died during its handoff: why (the reload failed).
        self.handoff_failed = ""
        self.state = "starting"  # then ready, reloading, stopping (tokend.status)

    def _bind_slot(self, index: int) -> Slot:
        s = self.settings
        listener = bind(s.host, s.port, s.backlog, reuse_port=True)
        admin = None
        if s.admin_port >= 0:
            # Each worker's metrics are its own, so each slot has its own admin port: the
            # configured one for the first, the next ones for the others (0: any free
            # port each, kept across reloads).
            port = s.admin_port + index - 1 if s.admin_port > 0 else 0
            admin = bind(s.admin_host, port, s.backlog, reuse_port=True)
        return Slot(index, listener, admin)

    # Running

    async def run(self) -> int:
        """Serve until stopped; the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reload_signal)
        loop.add_reader(self.notify_socket, self._notified)
        try:
            status = await self._serve()
            return await self._stop(status)
        finally:
            loop.remove_reader(self.notify_socket)
            self.notify_socket.close()
            for slot in self.slots:
                slot.close()
            for worker in list(self.processes.values()):  # only if the supervisor failed
                worker.process.kill()
                worker.process.wait()

    async def _serve(self) -> int:
        self._write_status("starting")
        for slot in self.slots:
            slot.worker = self._start(slot)
        live = [slot.worker for slot in self.slots if slot.worker is not None]
        outcome = await self._first(WORKER_READY_TIMEOUT, ready=_all_set(w.ready for w in live))
        if outcome is None:
            # As one process does (Redis down, say): wait on; a service manager's start
            # timeout decides.
            log.warning(
                "workers not ready yet",
                nodes=[w.name for w in live if not w.ready.is_set()],
                after_s=WORKER_READY_TIMEOUT,
            )
            outcome = await self._first(None, ready=_all_set(w.ready for w in live))
        if outcome == "ready":
            log.info("workers ready", generation=self.generation, nodes=self._nodes())
            self._ready()
        while outcome not in ("stop", "died"):
            outcome = await self._first(None, reload=self.reload_wanted.wait())
            if outcome == "reload":
                self.reload_wanted.clear()
                outcome = await self._reload()
        return 0 if outcome == "stop" else 1

    def _ready(self) -> None:
        """Every slot's worker is ready: say so to systemd and in the status file."""
        self.notifier.notify(READY="1", STATUS=self._summary(), MAINPID=str(os.getpid()))
        self._write_status("ready")

    async def _first(self, timeout: float | None, **waits: Awaitable[Any]) -> str | None:
        """The name of the first of ``waits`` to finish, or "stop" (a stop signal) or
        "died" (a live worker died), which are always watched and come first; None when
        ``timeout`` passed."""
        named = {"stop": self.stopping.wait(), "died": self.death.wait(), **waits}
        tasks = {asyncio.ensure_future(wait): name for name, wait in named.items()}
        try:
            done, _ = await asyncio.wait(tasks, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            for task in tasks:
                task.cancel()
        return next((name for task, name in tasks.items() if task in done), None)

    # Workers

    def _start(self, slot: Slot) -> Worker:
        name = worker_name(self.node_name, slot.index, self.generation)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sockets = [*slot.sockets(), (theirs, activation.SUPERVISOR)]
        argv, fds = activation.activated_command(WORKER_COMMAND, sockets)
        try:
            process = subprocess.Popen(
                argv,
                env=self._worker_environ(slot, name),
                stdin=subprocess.DEVNULL,
                pass_fds=fds,
                # Signals reach the workers through the supervisor alone: a terminal's
                # Ctrl-C starts one orderly stop, not N+1 of them.
                process_group=0,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        worker = Worker(slot, name, process, mine)
        self.processes[process.pid] = worker
        pidfd = os.pidfd_open(process.pid)
        loop = asyncio.get_running_loop()
        loop.add_reader(pidfd, self._exited, worker, pidfd)
        loop.add_reader(mine, self._reported, worker)
        log.info(
            "worker started",
            node=name,
            pid=process.pid,
            slot=slot.index,
            generation=self.generation,
        )
        return worker

    def _worker_environ(self, slot: Slot, name: str) -> dict[str, str]:
        """The supervisor's environment (its command line's settings included), with
        what the supervisor decides for the worker: its name, its sockets' addresses, the
        embedded Redis, where to report. The config file is read afresh by each worker."""
        listener = slot.listener.getsockname()
        admin = slot.admin.getsockname() if slot.admin is not None else None
        return {
            **self.environ,
            "TOKEND_WORKERS": "1",
            "TOKEND_NODE_NAME": name,
            "TOKEND_REDIS_URL": self.redis_url,
            "TOKEND_HOST": str(listener[0]),
            "TOKEND_PORT": str(listener[1]),
            "TOKEND_ADMIN_HOST": str(admin[0]) if admin else self.settings.admin_host,
            "TOKEND_ADMIN_PORT": str(admin[1]) if admin else "-1",
            "NOTIFY_SOCKET": self.notify_address,
        }

    def _exited(self, worker: Worker, pidfd: int) -> None:
        """The pidfd of ``worker`` is readable: it has exited."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(pidfd)
        os.close(pidfd)
        status = worker.process.wait()  # reaps it at once: it has exited
        del self.processes[worker.pid]
        loop.remove_reader(worker.channel)
        worker.channel.close()
        worker.exited.set()
        worker.handed.set()
        slot = worker.slot
        old = slot.handing_from
        if slot.worker is worker and old is not None and not self.stopping.is_set():
            # The new worker died while the old one handed it its connections: the old
            # one keeps what it still holds and serves the slot again; the reload failed.
            reason = f"new worker {worker.name} exited with status {status} during the handoff"
            log.error("new worker failed", node=worker.name, reason=reason, kept=old.name)
            slot.worker, slot.handing_from = old, None
            old.superseded = False
            with contextlib.suppress(OSError):
                activation.send_message(old.channel, {activation.ACCEPT: "1"})
            self.handoff_failed = self.handoff_failed or reason
            return
        live = slot.worker is worker
        if live and not self.stopping.is_set():
            log.error("worker died", node=worker.name, pid=worker.pid, exitcode=status)
            self.death.set()
        elif worker.superseded:
            (log.info if status == 0 else log.warning)(
                "old worker exited", node=worker.name, pid=worker.pid, exitcode=status
            )

    def _reported(self, worker: Worker) -> None:
        """A message on ``worker``'s channel: its handoff's report."""
        while (received := activation.receive_message(worker.channel)) is not None:
            fields, fds = received
            for fd in fds:
                os.close(fd)
            if not fields:
                asyncio.get_running_loop().remove_reader(worker.channel)
                return
            handed = fields.get(activation.HANDED)
            if handed is not None:
                worker.report = json.loads(handed)
                worker.handing = False
                worker.handed.set()

    def _notified(self) -> None:
        """Notifications wait on the supervisor's socket: apply each to its sender."""
        while (received := activation.receive_notification(self.notify_socket)) is not None:
            pid, fields = received
            worker = self.processes.get(pid)
            if worker is None:
                continue  # from a process that is not (or no longer) a worker
            if fields.get("READY") == "1":
                worker.ready.set()
            if fields.get(activation.DRAINED) == "1":
                worker.drained.set()

    # Signals

    def _stop_signal(self, sig: signal.Signals) -> None:
        if not self.stopping.is_set():
            log.info("signal received, stopping workers", signal=sig.name)
            self.stopping.set()
            return
        log.warning(
            "signal received again, killing workers",
            nodes=[w.name for w in self.processes.values()],
        )
        self.killed = True
        for worker in self.processes.values():
            worker.process.kill()

    def _reload_signal(self) -> None:
        if self.stopping.is_set():
            log.info("reload ignored: stopping")
            return
        self.requested += 1
        if self.reloading:
            log.info("reload requested during a reload: one more follows it")
        self.reload_wanted.set()
        self._write_status(self.state)

    # Reload

    async def _reload(self) -> str:
        """Replace every slot's worker: "ok" or "failed" (the supervisor goes on either
        way), or "stop" or "died".

        Two steps. First, the new workers start together; slot by slot, once the slot's
        new worker is ready and fewer than HANDOFFS_AT_ONCE slots are handing over, the
        old one stops accepting (SIGUSR1) and hands it its live connections
        (tokend/server/handoff.py). Then the old workers drain together
        (SIGTERM) what they could not hand over: those clients reconnect to the new
        workers alone, each session moves once, and the new workers share them evenly.
        (Draining each old worker as soon as its slot's new one is ready would send a
        quarter of its clients to each old worker not yet replaced; docs/operations.md.)
        """
        loop = asyncio.get_running_loop()
        began = loop.time()
        self.generation += 1
        answers = self.requested
        self.reloading = True
        log.info("reloading", generation=self.generation, workers=len(self.slots))
        self.notifier.notify(
            RELOADING="1",
            MONOTONIC_USEC=activation.monotonic_usec(),
            STATUS=f"reloading: generation {self.generation}",
        )
        self._write_status("reloading")
        outcome, reason = "ok", ""
        superseded: list[Worker] = []
        # Every new worker starts at once (their starts overlap rather than add up); then,
        # slot by slot, each replaces its slot's old one once ready and fewer than
        # HANDOFFS_AT_ONCE old workers are handing their connections over.
        starting = {slot.index: self._start(slot) for slot in self.slots}
        for slot in self.slots:
            old = slot.worker
            waited = await self._handing_fewer(superseded)
            if waited in ("stop", "died"):
                outcome = str(waited)
                break
            if self.handoff_failed:  # a new worker died in its handoff: the reload ends
                outcome, reason = "failed", self.handoff_failed
                break
            outcome, reason = await self._supersede(slot, starting.pop(slot.index))
            if outcome != "ok":
                break
            assert old is not None
            superseded.append(old)
        for new in starting.values():  # the later slots keep their old workers
            new.process.kill()
        for new in starting.values():
            await new.exited.wait()
        if outcome in ("ok", "failed"):
            # After a failure, the slots already replaced finish their move.
            drained = await self._drain(superseded)
            outcome = drained if drained != "ok" else outcome
        self.reloading = False
        if outcome in ("stop", "died"):
            return outcome
        if self.handoff_failed:
            outcome, reason = "failed", reason or self.handoff_failed
            self.handoff_failed = ""
        self.done = answers
        self.last_reload = {
            "generation": self.generation,
            "result": outcome,
            "reason": reason,
            "seconds": round(loop.time() - began, 1),
            **handoff_summary(superseded),
        }
        self._ready()
        (log.info if outcome == "ok" else log.error)(
            "reload finished", **self.last_reload, nodes=self._nodes()
        )
        return outcome

    async def _handing_fewer(self, old_workers: list[Worker]) -> str | None:
        """Until fewer than :data:`HANDOFFS_AT_ONCE` of ``old_workers`` are handing their
        connections over: None, or "stop" or "died" (or None after
        :data:`HANDOFF_TIMEOUT`: a starved handoff does not hold the others back)."""
        while True:
            handing = [w.handed for w in old_workers if not w.handed.is_set()]
            if len(handing) < HANDOFFS_AT_ONCE:
                return None
            outcome = await self._first(HANDOFF_TIMEOUT, handed=_any_set(handing))
            if outcome != "handed":
                return outcome

    async def _supersede(self, slot: Slot, new: Worker) -> tuple[str, str]:
        """Once the slot's ``new`` worker is ready, the old one stops accepting and hands
        it its connections. ("ok", ""), ("failed", why), ("stop", "") or ("died", "")."""
        old = slot.worker
        assert old is not None
        outcome = await self._first(
            WORKER_READY_TIMEOUT, ready=new.ready.wait(), exited=new.exited.wait()
        )
        if outcome in ("stop", "died"):
            return outcome, ""
        if outcome != "ready":
            reason = (
                f"new worker {new.name} exited with status {new.process.returncode}"
                if outcome == "exited"
                else f"new worker {new.name} not ready within {WORKER_READY_TIMEOUT:g} s"
            )
            log.error("new worker failed", node=new.name, reason=reason, kept=old.name)
            new.process.kill()
            await new.exited.wait()
            return "failed", reason
        slot.worker = new
        old.superseded = True
        old.process.send_signal(activation.STOP_ACCEPTING)
        log.info("worker replaced", slot=slot.index, old=old.name, new=new.name, pid=new.pid)
        self._hand_over(old, new)
        return "ok", ""

    def _hand_over(self, old: Worker, new: Worker) -> None:
        """Make the socketpair of the slot's two workers and give each its end: the old one
        hands its connections to the new one over it (tokend.server.handoff)."""
        give, take = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            activation.send_message(new.channel, {activation.HANDOFF: "take"}, take.fileno())
            activation.send_message(
                old.channel, {activation.HANDOFF: "give", "TO": new.name}, give.fileno()
            )
        except OSError as exc:  # either has exited: its own exit is handled
            log.warning("handoff not begun", old=old.name, new=new.name, error=str(exc))
            old.handed.set()
            return
        finally:
            give.close()
            take.close()
        old.handing = True
        old.slot.handing_from = old

    async def _drain(self, old_workers: list[Worker]) -> str:
        """Drain ``old_workers`` together, each over reload_drain_period (one after
        another, each over its share of it, the gaps between them, the last closing
        handshakes of one before the next began, would add up); each killed if it has not
        closed its connections within :data:`DRAIN_SLACK` x reload_drain_period +
        :data:`DRAIN_MARGIN`, then once all have, if it has not exited within
        :data:`EXIT_TIMEOUT`. "ok", or "stop" or "died"."""
        handing = [w.handed.wait() for w in old_workers]
        if handing:
            outcome = await self._first(HANDOFF_TIMEOUT, handed=asyncio.gather(*handing))
            if outcome in ("stop", "died"):
                return outcome
        # An old worker whose new one died during the handoff serves its slot again; the
        # others' slots are their new workers' for good.
        old_workers = [w for w in old_workers if w.superseded]
        for worker in old_workers:
            if worker.slot.handing_from is worker:
                worker.slot.handing_from = None
        if old_workers:
            log.info(
                "draining old workers",
                nodes=[w.name for w in old_workers],
                period=self.settings.reload_drain_period,
            )
        for old in old_workers:
            old.terminate()
        timeout = DRAIN_SLACK * self.settings.reload_drain_period + DRAIN_MARGIN
        drained = asyncio.gather(*(_drained_or_exited(w) for w in old_workers))
        outcome = await self._first(timeout, drained=drained)
        if outcome in ("stop", "died"):
            return outcome
        if outcome is None:
            late = [w for w in old_workers if not (w.drained.is_set() or w.exited.is_set())]
            log.warning(
                "old workers still draining: killed", nodes=[w.name for w in late], after_s=timeout
            )
            for old in late:
                old.process.kill()
        outcome = await self._first(EXIT_TIMEOUT, exited=_all_set(w.exited for w in old_workers))
        if outcome is None:
            log.warning("old workers slow to exit: killed", nodes=[w.name for w in old_workers])
            for worker in old_workers:
                worker.process.kill()
            outcome = await self._first(None, exited=_all_set(w.exited for w in old_workers))
        return "ok" if outcome == "exited" else str(outcome)

    # Stopping

    async def _stop(self, status: int) -> int:
        self.stopping.set()
        self.notifier.notify(STOPPING="1")
        self._write_status("stopping")
        for slot in self.slots:
            slot.close()  # the port closes as the workers close their copies
        for running in self.processes.values():
            running.terminate()
        await _all_set(w.exited for w in list(self.processes.values()))
        for slot in self.slots:
            worker = slot.worker
            if worker is not None and worker.process.returncode != 0 and status == 0:
                log.error(
                    "worker stopped uncleanly",
                    node=worker.name,
                    exitcode=worker.process.returncode,
                )
                status = 1
        return 1 if self.killed else status

    # State

    def _nodes(self) -> list[str]:
        return [slot.worker.name for slot in self.slots if slot.worker is not None]

    def _summary(self) -> str:
        return f"{len(self.slots)} workers ready, generation {self.generation}"

    def _write_status(self, state: str) -> None:
        self.state = state
        self.pidfile.write_status(
            {
                "workers": len(self.slots),
                "state": state,
                "generation": self.generation,
                "nodes": self._nodes(),
                "worker_pids": [slot.worker.pid for slot in self.slots if slot.worker],
                "reloads_requested": self.requested,
                "reloads_done": self.done,
                "last_reload": self.last_reload,
            }
        )


def handoff_summary(old_workers: Iterable[Worker]) -> dict[str, Any]:
    """What the reload's handoffs did, all old workers together: connections moved, and
    those that fell back to a close (1001), by reason."""
    moved = 0
    fell_back: Counter[str] = Counter()
    for worker in old_workers:
        if worker.report is not None:
            moved += int(worker.report.get("moved", 0))
            fell_back.update(worker.report.get("fell_back", {}))
    return {"moved": moved, "fell_back": dict(sorted(fell_back.items()))}


async def _any_set(events: Iterable[asyncio.Event]) -> None:
    """Until one of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when="FIRST_COMPLETED")
    finally:
        for wait in waits:
            wait.cancel()


async def _all_set(events: Iterable[asyncio.Event]) -> None:
    for event in list(events):
        await event.wait()


async def _drained_or_exited(worker: Worker) -> None:
    """Until ``worker`` has closed its connections, or exited (having closed them or not)."""
    await _any_set((worker.drained, worker.exited))


def supervise(settings: Settings, environ: Mapping[str, str]) -> int:
    """Run ``settings.workers`` workers, each started with ``environ`` (the supervisor's
    environment and command line); the exit status."""
    if activation.listen_fds(os.environ, os.getpid()):
        raise ConfigError(
            "workers: the supervisor binds its own sockets and keeps them across reloads; "
            "socket activation (LISTEN_FDS) is for one process (docs/operations.md)"
        )
    pidfile = PidFile(settings.resolved_data_dir)
    pidfile.acquire()
    notifier = activation.Notifier.from_environ()
    embedded = None
    try:
        redis_url = settings.redis_url
        if not redis_url:
            embedded = EmbeddedRedis(settings.resolved_data_dir)
            embedded.start()
            redis_url = embedded.url
        supervisor = Supervisor(settings, environ, redis_url, pidfile, notifier)
        status = asyncio.run(supervisor.run())
    finally:
        if embedded is not None:
            embedded.stop()
        pidfile.release()
    log.info("workers stopped", status=status)
    return status
