"""A real HAProxy on loopback, its configuration derived from a shipped one.

:func:`on_loopback` turns a file of ``config/`` (written for Docker: service names,
Docker's DNS resolver, port 8765) into the same configuration on loopback ports, and
:class:`HAProxy` runs it in the foreground and reads its servers' states from its
stats socket.
"""

from __future__ import annotations

import csv
import re
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

from testkit.net import LOOPBACK, free_port
from testkit.procs import terminate
from testkit.waiting import eventually_sync


def _sub(pattern: str, replacement: str, text: str, count: int = 1) -> str:
    """``re.sub``, failing unless the pattern matched exactly ``count`` times: a shipped
    file that changed shape must fail the test, not be half derived."""
    derived, found = re.subn(pattern, replacement, text, flags=re.MULTILINE)
    if found != count:
        raise AssertionError(f"{pattern!r} matched {found} times in the shipped config")
    return derived


def on_loopback(
    shipped: str,
    port: int,
    servers: Mapping[str, int],
    stats_socket: Path,
    check_interval_ms: int,
) -> str:
    """The shipped configuration with only what Docker provides swapped: the listener
    on ``LOOPBACK:port``, the servers on loopback ports, no Docker resolver; plus a
    stats socket, and health checks every ``check_interval_ms`` rather than seconds
    apart (the same checks, sooner; each still given 2 s to answer, as the shipped
    interval gives it, on a machine that may be busy). Everything else as shipped."""
    text = shipped
    if "resolvers docker" in text:
        text = _sub(r"^resolvers docker\n(?:[ \t]+\S.*\n)+", "", text)
        text = _sub(r" resolvers docker init-addr \S+", "", text)
    text = _sub(r"^(\s*bind\s+)\S*:8765\b", rf"\g<1>{LOOPBACK}:{port}", text)
    text = _sub(r"\binter \d+s\b", f"inter {check_interval_ms}ms", text)
    text = _sub(r"^defaults\n", "defaults\n    timeout check 2s\n", text)
    shipped_servers = len(re.findall(r"^\s*server\s", text, re.MULTILINE))
    text = _sub(r"^\s*server\s.*\n", "", text, count=shipped_servers)
    if not re.search(r"^backend\s", text.rsplit("\n\n", 1)[-1], re.MULTILINE):
        raise AssertionError("the shipped config does not end with its backend")
    text = text.rstrip("\n") + "\n"
    text += "".join(f"    server {name} {LOOPBACK}:{p}\n" for name, p in servers.items())
    return _sub(
        r"^global\n", f"global\n    stats socket {stats_socket} mode 600 level admin\n", text
    )


class HAProxy:
    """``haproxy -db -f CONFIG`` (foreground), logging to ``directory/haproxy.log``."""

    def __init__(self, binary: Path, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.stats_socket = directory / "stats.sock"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, config: str) -> None:
        path = self.directory / "haproxy.cfg"
        path.write_text(config)
        check = subprocess.run(
            [str(self.binary), "-c", "-f", str(path)], capture_output=True, text=True
        )
        if check.returncode != 0:
            raise AssertionError(f"haproxy -c refused the config:\n{check.stdout}{check.stderr}")
        with (self.directory / "haproxy.log").open("wb") as log:
            self.process = subprocess.Popen(
                [str(self.binary), "-db", "-f", str(path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        eventually_sync(self._listening, 10, what="haproxy listening")

    def _listening(self) -> bool:
        """Whether the stats socket answers (HAProxy binds its listeners before): no
        probe through the frontend, which in TCP mode would reach a node."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"haproxy exited: {self.log()}")
        try:
            return bool(self._command(b"show info\n"))
        except OSError:
            return False

    def log(self) -> str:
        return (self.directory / "haproxy.log").read_text(errors="replace")

    def servers(self) -> dict[str, dict[str, str]]:
        """Each server of each backend (``backend/server``) with its stats: ``status``
        (UP, DOWN, ...), ``check_status`` (L7OK: the HTTP check answered as expected)."""
        reply = self._command(b"show stat\n")
        rows = csv.DictReader(reply.decode().removeprefix("# ").splitlines())
        return {
            f"{row['pxname']}/{row['svname']}": row
            for row in rows
            if row["svname"] not in ("FRONTEND", "BACKEND")
        }

    def _command(self, command: bytes) -> bytes:
        with socket.socket(socket.AF_UNIX) as stats:
            stats.settimeout(5)
            stats.connect(str(self.stats_socket))
            stats.sendall(command)
            reply = b""
            while chunk := stats.recv(65536):
                reply += chunk
        return reply

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process, 10)
