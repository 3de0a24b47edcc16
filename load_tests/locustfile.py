"""Locust load test for tokend, speaking protocol v1 over ``websockets.sync.client``.

Each simulated user holds one session: connect + HELLO -> WELCOME, then one
heartbeat per interval (the server's cadence from WELCOME, or
``--heartbeat-ms``), each timed until its ACK. Every step is reported to
locust's statistics (request type ``WS``):

* ``connect+hello``  - TCP + WebSocket handshake + HELLO until WELCOME
* ``heartbeat``      - HEARTBEAT until its ACK (the ACK latency)
* ``renewal``        - an ACK that carried a renewed token (same latency as its heartbeat)
* ``token re-sent``  - an ACK that re-sent the current token (exp mismatch)
* ``notice``         - a WARN NOTICE: the server missed this user's heartbeats (a failure)
* ``bye``            - BYE until the server's close 1000, when the user stops

A close the user did not ask for, or no reply within 10 s, fails the step it
interrupted (``CloseError`` with the close code). The user then reconnects and
resumes with its newest token after a reconnectable code or a lost connection,
and starts over with a new token after a terminal one. It waits before each
attempt as the Python SDK does (:class:`tokend.client.Backoff`): the first
reconnect after a 1001 (the server drains, reloads or stops) at a random time
within ``--going-away-window`` seconds (default 5), an HTTP 503 or 429 at least
its Retry-After, anything else the SDK's full-jitter backoff; and its resumes
carry the resume proof made with the session key of its last WELCOME.

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
import math
import os
import time
import uuid
from typing import Any

import jwt
from locust import User, events, task
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tokend import config
from tokend import protocol as p
from tokend.client import Backoff, going_away_limit, retry_after
from tokend.tokens import KeyRing, TokenService

# How long a reply may take before the step counts as failed.
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


class CloseError(Exception):
    """The server closed the connection; ``code`` is its close code (None: no close frame)."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"{code} {reason}" if code is not None else "connection lost")
        self.code = code


def _close_error(exc: ConnectionClosed) -> CloseError:
    if exc.rcvd is None:
        return CloseError(None, "")
    return CloseError(exc.rcvd.code, exc.rcvd.reason)


class TokendUser(User):
    """One tokend session: heartbeats at the cadence, renewals, reconnects."""

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        self.ws: ClientConnection | None = None
        self._held = contextlib.ExitStack()  # closes self.ws
        self.welcome: p.Welcome | None = None
        self.token = ""
        self.session_key: bytes | None = None  # of the last WELCOME: the resume proof's
        self.exp_ms = 0
        self.backoff = Backoff()
        self.failures = 0  # connection attempts in a row that got no heartbeat ACK
        self.seq = 0
        self.interval = 1.0
        self.next_due = time.monotonic()
        self.in_flight: float | None = None  # perf_counter() when the unACKed heartbeat left

    def on_start(self) -> None:
        window = self.environment.parsed_options.going_away_window
        self.backoff = Backoff(going_away_window=window)
        self.token = _mint()
        self._open()

    def wait_time(self) -> float:
        """Sleep until the next heartbeat is due."""
        return max(0.0, self.next_due - time.monotonic())

    @property
    def url(self) -> str:
        host = (self.host or "").rstrip("/")
        return host if host.endswith(p.WS_PATH) else host + p.WS_PATH

    def _report(
        self, name: str, started: float, length: int = 0, exc: Exception | None = None
    ) -> None:
        self.environment.events.request.fire(
            request_type="WS",
            name=name,
            response_time=(time.perf_counter() - started) * 1000,
            response_length=length,
            exception=exc,
            context={},
        )

    def _drop(self) -> None:
        """Close the connection, if any."""
        self.ws = None
        self._held.close()

    def _retry_in(self, delay: float) -> None:
        """The next connection attempt after ``delay`` seconds (one more failure in a row)."""
        self.failures += 1
        self.next_due = time.monotonic() + delay

    def _open(self) -> None:
        """Connect and say HELLO with the newest token (a resume if the session lives),
        proving with the last WELCOME's key if there was one."""
        started = time.perf_counter()
        try:
            ws = self._held.enter_context(
                connect(
                    self.url,
                    subprotocols=[p.SUBPROTOCOL],  # type: ignore[list-item]
                    compression=None,
                    open_timeout=REPLY_TIMEOUT,
                    ping_interval=None,  # heartbeats are the liveness check
                    close_timeout=2,
                    proxy=None,
                    max_size=p.ACK_HEAD_LENGTH + p.MAX_TOKEN_LENGTH,
                )
            )
        except InvalidStatus as exc:  # e.g. 503 with Retry-After
            self._report("connect+hello", started, exc=exc)
            asked = retry_after(exc.response.headers.get("Retry-After"))
            if asked is None:
                self._retry_in(self.backoff.delay(self.failures))
            else:
                self._retry_in(self.backoff.after_refusal(self.failures, asked))
            return
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            self._report("connect+hello", started, exc=exc)
            self._retry_in(self.backoff.delay(self.failures))
            return
        key = self.session_key
        proof = None if key is None else p.resume_proof(key, self._tid_bytes())
        try:
            ws.send(p.encode(p.Hello(self.token, proof=proof)))
            frame = p.decode(ws.recv(timeout=REPLY_TIMEOUT))
            if not isinstance(frame, p.Welcome):
                raise p.ProtocolError(f"expected WELCOME, got {type(frame).__name__}")
        except ConnectionClosed as exc:
            self._closed(_close_error(exc), started, "connect+hello")
            return
        except (TimeoutError, p.ProtocolError) as exc:
            self._report("connect+hello", started, exc=exc)
            self._drop()
            self._retry_in(self.backoff.delay(self.failures))
            return
        self._report("connect+hello", started, length=p.WELCOME_LENGTH)
        self.ws, self.welcome, self.seq = ws, frame, 0
        self.session_key = frame.session_key
        self.exp_ms = jwt.decode(self.token, options={"verify_signature": False})["exp"] * 1000
        override = self.environment.parsed_options.heartbeat_ms
        self.interval = (override or frame.heartbeat_ms) / 1000
        self.next_due = time.monotonic() + self.interval

    def _tid_bytes(self) -> bytes:
        claims = jwt.decode(self.token, options={"verify_signature": False})
        return uuid.UUID(claims["jti"]).bytes

    def _closed(self, error: CloseError, started: float, name: str) -> None:
        """An unasked-for close: a failure. Resume later, or move on to a new token."""
        self._report(name, started, exc=error)
        self._drop()
        if error.code is not None and error.code not in p.RECONNECTABLE:
            self.token, self.session_key = _mint(), None
        if error.code == p.CloseCode.GOING_AWAY:
            spare = math.inf if self.welcome is None else going_away_limit(self.welcome)
            self._retry_in(self.backoff.after_going_away(self.failures, spare))
        else:
            self._retry_in(self.backoff.delay(self.failures))

    @task
    def heartbeat(self) -> None:
        """One heartbeat, timed until its ACK; a due reconnect instead if disconnected."""
        if self.ws is None or self.welcome is None:
            self._open()
            return
        self.seq += 1
        hb = p.make_heartbeat(self.welcome.session_key, self.welcome.tid, self.seq, self.exp_ms)
        # Keep the cadence; after falling behind, restart it from now rather than burst.
        now = time.monotonic()
        self.next_due += self.interval
        if self.next_due <= now:
            self.next_due = now + self.interval
        started = self.in_flight = time.perf_counter()
        try:
            self.ws.send(p.encode(hb))
            while self.in_flight is not None:
                self._take(p.decode(self.ws.recv(timeout=REPLY_TIMEOUT)))
        except ConnectionClosed as exc:
            self.in_flight = None
            self._closed(_close_error(exc), started, "heartbeat")
        except (TimeoutError, p.ProtocolError) as exc:
            self.in_flight = None
            self._report("heartbeat", started, exc=exc)
            self._drop()

    def _take(self, frame: p.Frame) -> None:
        """A frame from the server after WELCOME: report it, take in a new token."""
        if isinstance(frame, p.Notice):
            self._report("notice", time.perf_counter(), exc=Exception("session in WARN"))
            return
        if not isinstance(frame, p.HeartbeatAck) or self.in_flight is None:
            raise p.ProtocolError(f"unexpected {type(frame).__name__}")
        started, self.in_flight = self.in_flight, None
        self.failures = 0  # as the SDK: a connection that got an ACK starts the count again
        self._report("heartbeat", started, length=p.ACK_HEAD_LENGTH)
        if frame.token is not None:
            self.token, self.exp_ms = frame.token, frame.exp_ms
            name = "renewal" if frame.renewed else "token re-sent"
            self._report(name, started, length=len(frame.token))

    def on_stop(self) -> None:
        """Log out: BYE, then the server's close 1000.

        A user stopped while waiting for an ACK still counts that ACK (and its
        renewal) when it arrives before the close.
        """
        ws = self.ws
        if ws is None:
            return
        started = time.perf_counter()
        try:
            ws.send(p.encode(p.Bye()))
            while True:
                self._take(p.decode(ws.recv(timeout=REPLY_TIMEOUT)))
        except ConnectionClosed as exc:
            error = _close_error(exc)
            ok = error.code == p.CloseCode.NORMAL
            self._report("bye", started, exc=None if ok else error)
        except (TimeoutError, p.ProtocolError) as exc:
            self._report("bye", started, exc=exc)
        finally:
            self._drop()
