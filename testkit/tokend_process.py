"""``tokend serve`` as a child process on a loopback port, with its JSON log read as
it comes; several of them configured alike."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from testkit.net import LOOPBACK, free_port
from tokend import config
from tokend.config import Settings
from tokend.ops import activation

# Clocks short enough to watch WARN and EXPIRED happen in a test (tests/conftest.py's apps).
SHORT_CLOCKS: dict[str, Any] = {
    "heartbeat_interval": 0.2,
    "warn_after": 0.6,
    "expire_after": 1.2,
    "sweep_interval": 0.05,
    "hello_timeout": 1.0,
    "redis_timeout": 1.0,
    "token_ttl": 60,
    "renew_window": 2,
}
# Clocks no test step outlasts (a subprocess's start-up included): no WARN or expiry
# where a test is about something else.
CALM_CLOCKS: dict[str, Any] = {"heartbeat_interval": 5.0, "warn_after": 20.0, "expire_after": 30.0}
# The environment a newcomer has: no TOKEND_* settings at all.
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("TOKEND_")}


def node_env(settings: Settings) -> dict[str, str]:
    """Every setting as its ``TOKEND_*`` variable: a tokend process configured like ``settings``."""
    return {config.env_name(name): str(getattr(settings, name)) for name in config.FIELDS}


class TokendProcess:
    """``tokend serve`` as a child process on a loopback port.

    Its stderr (JSON log lines) is read all along by a thread into ``log_lines``, so
    that a busy node never blocks on a full pipe; a line that is not JSON is kept as
    ``{"raw": line}``.
    """

    def __init__(
        self,
        env: dict[str, str],
        port: int | None = None,
        *,
        max_open_files: int | None = None,
        sockets: Sequence[tuple[socket.socket, str]] = (),
    ) -> None:
        # Listening sockets passed as systemd's socket activation does (LISTEN_FDS), each
        # with its name; the first is the WebSocket port.
        self.sockets = sockets
        self.port = port or (sockets[0][0].getsockname()[1] if sockets else free_port())
        # A known admin port, unless the test names one (-1: off) or runs workers (then
        # 0: each worker takes a free one; consecutive ports may not be free).
        admin_port = env.get("TOKEND_ADMIN_PORT", "0")
        workers = int(env.get("TOKEND_WORKERS", "1"))
        self.admin_port = free_port() if admin_port == "0" and workers == 1 else int(admin_port)
        self.max_open_files = max_open_files  # RLIMIT_NOFILE of the child, if set
        self.env = {
            **os.environ,
            **env,
            "TOKEND_ADMIN_PORT": str(self.admin_port),
            "TOKEND_PORT": str(self.port),
            "TOKEND_HOST": LOOPBACK,
            "TOKEND_LOG_FORMAT": "json",
        }
        # A supervisor's workers each log their own `listening` line.
        self.listeners = workers
        self.process: subprocess.Popen[bytes] | None = None
        self.log_lines: list[dict[str, Any]] = []
        self._logged = threading.Condition()
        self._output_ended = False
        self._reader: threading.Thread | None = None

    def launch(self) -> None:
        command = [sys.executable, "-m", "tokend", "serve"]
        fds: tuple[int, ...] = ()
        if self.sockets:  # as systemd would start it: see tokend/ops/activation.py
            command, fds = activation.activated_command(command, self.sockets)
        self.process = subprocess.Popen(
            command,
            pass_fds=fds,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=self._limit if self.max_open_files else None,
        )
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()

    def _read_log(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            try:
                entry = json.loads(line)
            except ValueError:
                entry = {"raw": line.decode(errors="replace")}
            with self._logged:
                self.log_lines.append(entry)
                self._logged.notify_all()
        with self._logged:
            self._output_ended = True
            self._logged.notify_all()

    def logged(self, event: str) -> list[dict[str, Any]]:
        return [entry for entry in self.log_lines if entry.get("event") == event]

    def wait_logged(self, event: str, count: int = 1, timeout: float = 20) -> list[dict[str, Any]]:
        """The log lines of ``event`` once there are ``count``; raises if tokend exits first."""
        assert self.process is not None
        with self._logged:
            if not self._logged.wait_for(
                lambda: len(self.logged(event)) >= count or self._output_ended, timeout
            ):
                raise RuntimeError(f"tokend did not log {event!r}; log: {self.log_lines[-5:]}")
            if len(self.logged(event)) < count:
                status = self.process.wait(timeout)
                raise RuntimeError(f"tokend exited: {status}; log: {self.log_lines[-5:]}")
            return self.logged(event)

    def start(self, timeout: float = 20) -> None:
        self.launch()
        self.wait_listening(timeout)

    def wait_listening(self, timeout: float = 20) -> None:
        self.wait_logged("listening", self.listeners, timeout)

    def reload(self, timeout: float = 30) -> dict[str, Any]:
        """SIGHUP to a supervisor; its ``reload finished`` line, once logged."""
        assert self.process is not None
        count = len(self.logged("reload finished"))
        self.process.send_signal(signal.SIGHUP)
        return self.wait_logged("reload finished", count + 1, timeout)[-1]

    def _limit(self) -> None:
        assert self.max_open_files is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.max_open_files, self.max_open_files))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        status = self.process.wait(timeout=timeout)
        if self._reader is not None:
            # Output ends when the last process holding the pipe (a child too) exits.
            self._reader.join(timeout=timeout)
        return status

    def kill(self) -> int:
        return self.stop(signal.SIGKILL)


@contextlib.contextmanager
def running_nodes(settings: Settings, *names: str) -> Iterator[list[TokendProcess]]:
    """One tokend process per name, configured like ``settings``, started together;
    each is stopped (SIGTERM) at the end unless the test already stopped it."""
    nodes = [TokendProcess({**node_env(settings), "TOKEND_NODE_NAME": name}) for name in names]
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_listening()
        yield nodes
    finally:
        for node in nodes:
            if node.process is not None:
                node.stop()


def tokend(
    *args: str, env: dict[str, str], timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """``tokend ARGS`` run to its end, with ``env`` added to :data:`CLEAN_ENV`."""
    return subprocess.run(
        [sys.executable, "-m", "tokend", *args],
        env={**CLEAN_ENV, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def serve_refused(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    """``tokend serve`` that must refuse to start: run to its end (at most 60 s, else
    TimeoutExpired: it served)."""
    return tokend("serve", *flags, env=env, timeout=60)
