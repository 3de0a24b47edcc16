"""Locust load test for tokend: the SDK's client core driven over ``websockets.sync.client``.

Each simulated user holds one session, spoken by a :class:`tokend_client.core.ClientCore`
(the Python SDK's protocol rules, Sans-I/O) that this user drives with a blocking
WebSocket: connect + HELLO -> WELCOME, then one heartbeat per interval (the server's
cadence from WELCOME, or ``--heartbeat-ms``), each timed until its ACK. Every step is
reported to locust's statistics (request type ``WS``):

* ``connect+hello``  - TCP + WebSocket handshake + HELLO until WELCOME
* ``heartbeat``      - HEARTBEAT until its ACK (the ACK latency)
* ``renewal``        - an ACK that carried a renewed token (same latency as its heartbeat)
* ``token re-sent``  - an ACK that re-sent the current token (exp mismatch)
* ``notice``         - a WARN NOTICE: the server missed this user's heartbeats (a failure)
* ``bye``            - BYE until the server's close 1000, when the user stops

A close the user did not ask for, or a link silent for ``warn_after``, fails the step it
interrupted (:class:`Interrupted`, with the close code or what happened). As the core
decides, the user then reconnects and resumes with its newest token, proving with the
session key of its last WELCOME, after a reconnectable code or a lost connection; and
starts over with a new token after a terminal one. It waits before each attempt as the
SDK does (:class:`tokend_client.backoff.Backoff`): the first reconnect after a 1001 (the
server drains, reloads or stops) at a random time within ``--going-away-window`` seconds
(default 5), an HTTP 503 or 429 at least its Retry-After, anything else full-jitter
backoff.

Each user mints its token when it starts, with the server's signing keys, found
like ``tokend issue`` finds them: from the ``TOKEND_*`` settings (``TOKEND_DATA_DIR``
or ``TOKEND_KEYS_DIR``; lifetime ``TOKEND_TOKEN_TTL``). Minting at start rather than
ahead keeps even a few-second token valid however long locust takes to start.
Locust runs on gevent, hence the blocking client.

    TOKEND_DATA_DIR=/tmp/tokend-demo locust -f load_tests/locustfile.py --headless \
        -u 100 -r 50 -t 60s --host ws://127.0.0.1:8765

``load_tests/run.py`` does all of it: server, locust, summary.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable
from typing import Any

from locust import User, events, task
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from tokend import config
from tokend.tokens.keys import KeyRing
from tokend.tokens.service import TokenService
from tokend_client import protocol as p
from tokend_client.backoff import Backoff
from tokend_client.core import (
    MAX_SERVER_MESSAGE,
    ON_A_CONNECTION,
    Change,
    ClientCore,
    Lifecycle,
    Phase,
)

# How long the opening handshake, a WELCOME, or the server's close after BYE may take.
REPLY_TIMEOUT = 10.0
_minter: TokenService | None = None
_minted = itertools.count(1)


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    parser.add_argument(
        "--heartbeat-ms",
        type=int,
        env_var="TOKEND_LOAD_HEARTBEAT_MS",
        default=0,
        help="heartbeat interval in ms (default 0: the server's cadence from WELCOME)",
    )
    parser.add_argument(
        "--going-away-window",
        type=float,
        env_var="TOKEND_LOAD_GOING_AWAY_WINDOW",
        default=Backoff().going_away_window,
        help="after a close 1001 the first reconnect waits a random time up to this many "
        "seconds (default 5)",
    )


def _mint() -> str:
    """A new token (a new session) signed with the server's keys, as ``tokend issue`` does."""
    global _minter
    if _minter is None:
        settings = config.load()
        _minter = TokenService(settings, KeyRing.open(settings.resolved_keys_dir))
    return _minter.mint(f"load-{os.getpid()}-{next(_minted)}")


class Interrupted(Exception):
    """A step did not finish: the connection closed (``code``, the close code; None when
    no close frame came) or was let go, as the lifecycle change says."""

    def __init__(self, change: Lifecycle) -> None:
        # Without the change's "; attempt n in x s", so that locust counts alike failures
        # as one.
        what = change.detail.partition("; attempt ")[0]
        super().__init__(f"{change.code} {change.reason}" if change.code is not None else what)
        self.code = change.code


class TokendUser(User):
    """One tokend session: heartbeats at the cadence, renewals, reconnects."""

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        self.core: ClientCore | None = None
        self.ws: ClientConnection | None = None
        self._held = contextlib.ExitStack()  # closes self.ws
        self.step = "connect+hello"  # the step a close would interrupt
        self.step_began = time.perf_counter()

    def on_start(self) -> None:
        self.core = self._session(_mint())
        self._open()

    def _session(self, token: str) -> ClientCore:
        options = self.environment.parsed_options
        return ClientCore(
            token,
            clock=time.monotonic,
            backoff=Backoff(going_away_window=options.going_away_window),
            open_timeout=REPLY_TIMEOUT,
            close_timeout=REPLY_TIMEOUT,
            cadence=options.heartbeat_ms / 1000 or None,
        )

    @property
    def session(self) -> ClientCore:
        assert self.core is not None, "on_start makes the session"
        return self.core

    def wait_time(self) -> float:
        """Sleep until the core's next deadline (a heartbeat, a reconnect attempt)."""
        deadline = self.session.deadline
        return 0.0 if deadline is None else max(0.0, deadline - time.monotonic())

    @property
    def url(self) -> str:
        host = (self.host or "").rstrip("/")
        return host if host.endswith(p.WS_PATH) else host + p.WS_PATH

    def _report(
        self, name: str, seconds: float, length: int = 0, exc: Exception | None = None
    ) -> None:
        self.environment.events.request.fire(
            request_type="WS",
            name=name,
            response_time=seconds * 1000,
            response_length=length,
            exception=exc,
            context={},
        )

    def _begin(self, step: str) -> None:
        self.step, self.step_began = step, time.perf_counter()

    @task
    def heartbeat(self) -> None:
        """What is due: a heartbeat, timed until its ACK; or the next connection attempt."""
        core = self.session
        if core.phase is Phase.CONNECT:
            self._open()
            return
        beats, acks = core.stats.heartbeats, core.stats.acks
        core.tick()
        self._act()
        self._until_acked(beats, acks)

    def _until_acked(self, beats: int, acks: int) -> None:
        """If a heartbeat went out since the counts were ``beats`` and ``acks``, read until
        an ACK comes (a heartbeat step)."""
        core = self.session
        if core.stats.heartbeats > beats:
            self._begin("heartbeat")
            self._serve(lambda: core.stats.acks > acks)

    def _open(self) -> None:
        """Connect; the core says HELLO (a resume, proved, if the session lives), and the
        user reads until WELCOME."""
        core = self.session
        beats, acks = core.stats.heartbeats, core.stats.acks
        self._begin("connect+hello")
        try:
            ws = self._held.enter_context(
                connect(
                    self.url,
                    subprotocols=[Subprotocol(p.SUBPROTOCOL)],
                    compression=None,
                    open_timeout=REPLY_TIMEOUT,
                    ping_interval=None,  # heartbeats are the liveness check
                    close_timeout=2,
                    proxy=None,
                    max_size=MAX_SERVER_MESSAGE,
                )
            )
        except InvalidStatus as exc:  # e.g. 503 with Retry-After
            core.refused(exc.response.status_code, exc.response.headers.get("Retry-After"))
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            core.lost(f"cannot connect: {exc or type(exc).__name__}")
        else:
            self.ws = ws
            core.opened(ws.subprotocol)
        self._act()
        self._serve(lambda: core.phase is not Phase.HELLO)
        self._until_acked(beats, acks)  # the heartbeat WELCOME is answered with

    def _serve(self, done: Callable[[], bool]) -> None:
        """Read from the server into the core until ``done()`` or the connection is let
        go; at the core's deadline (a heartbeat due meanwhile, silence, a timeout) tick it."""
        core = self.session
        while self.ws is not None and core.phase in ON_A_CONNECTION and not done():
            deadline = core.deadline
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                data = self.ws.recv(timeout=timeout)
            except TimeoutError:
                core.tick()
            except ConnectionClosed as exc:
                core.closed(exc.rcvd, exc.sent)
            else:
                acks = core.stats.acks
                core.receive(data)
                if core.stats.acks > acks and core.stats.last_rtt is not None:
                    self._report("heartbeat", core.stats.last_rtt, p.ACK_HEAD_LENGTH)
            self._act()

    def _act(self) -> None:
        """Do what the core says: send its frames, let the connection go, report its
        lifecycle changes; a session ended for good starts over with a new token."""
        core = self.session
        for item in core.take_outgoing():
            if self.ws is None:
                break
            if isinstance(item, bytes):
                with contextlib.suppress(ConnectionClosed):  # the next read says how
                    self.ws.send(item)
            else:  # closed with the code, or (None) at once
                if item.code is not None:
                    self.ws.close(item.code, item.reason)
                self._drop()
        for change in core.take_changes():
            self._report_change(change, core)
        if core.phase not in ON_A_CONNECTION:
            self._drop()
        if core.ended and core.error is not None:
            self.core = self._session(_mint())

    def _report_change(self, change: Lifecycle, core: ClientCore) -> None:
        since = time.perf_counter() - self.step_began
        match change.kind:
            case Change.CONNECTED | Change.RESUMED:
                self._report("connect+hello", since, p.WELCOME_LENGTH)
            case Change.RENEWED:
                assert change.token is not None
                name = "renewal" if change.detail == "renewed" else "token re-sent"
                self._report(name, core.stats.last_rtt or since, len(change.token))
            case Change.WARNED:
                self._report("notice", 0.0, exc=Exception("session in WARN"))
            case Change.RECONNECTING:
                self._report(self.step, since, exc=Interrupted(change))
            case Change.ENDED if self.step == "bye":
                ok = change.code == p.CloseCode.NORMAL
                self._report("bye", since, exc=None if ok else Interrupted(change))
            case Change.ENDED:
                self._report(self.step, since, exc=Interrupted(change))

    def _drop(self) -> None:
        """Close the connection, if any."""
        self.ws = None
        self._held.close()

    def on_stop(self) -> None:
        """Log out: BYE, then the server's close 1000.

        A user stopped while waiting for an ACK still counts that ACK (and its
        renewal) when it arrives before the close.
        """
        core = self.session
        if not core.connected:
            self._drop()
            return
        self._begin("bye")
        core.close()
        self._act()
        self._serve(lambda: False)
