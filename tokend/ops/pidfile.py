"""The running server's pid file and status file, in its data directory.

``tokend serve`` (the supervisor of ``--workers N``, or the one process) holds
``<data_dir>/tokend.pid`` with an exclusive flock for as long as it runs, and writes its
pid in it; beside it, ``tokend.status`` (JSON, replaced whole) says what it is doing:
its workers, their generation, whether a reload runs, how the last one ended. A pid file
that nobody holds locked is stale: its server has exited without removing it (a crash,
SIGKILL). ``tokend reload`` finds the server through both (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

PID_FILE = "tokend.pid"
STATUS_FILE = "tokend.status"
# How long a starting server tries for the lock: `tokend reload` holds a shared lock for
# an instant while it checks whether a server runs.
LOCK_PATIENCE_S = 1.0
_LOCK_RETRY_S = 0.05


class AlreadyRunning(RuntimeError):
    """Another server holds this data directory's pid file."""


class NoServer(RuntimeError):
    """No server runs on this data directory (no pid file, or a stale one)."""


class PidFile:
    """This server's hold on ``<data_dir>/tokend.pid`` and its status file."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / PID_FILE
        self.status_path = data_dir / STATUS_FILE
        self._fd: int | None = None

    def acquire(self, patience: float = LOCK_PATIENCE_S) -> None:
        """Lock the pid file and write this process's pid in it; raises
        :class:`AlreadyRunning` naming the holder when another server has it after
        ``patience`` seconds."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + patience
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise AlreadyRunning(
                        f"another tokend serve (pid {holder}) runs on this data directory "
                        f"({self.path} is locked)"
                    ) from None
                time.sleep(_LOCK_RETRY_S)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def write_status(self, status: dict[str, Any]) -> None:
        """Replace the status file whole (readers never see half of it)."""
        if self._fd is None:
            return
        partial = self.status_path.with_suffix(".partial")
        partial.write_text(json.dumps({"pid": os.getpid(), **status}))
        partial.replace(self.status_path)

    def release(self) -> None:
        """Remove both files, then let go of the lock."""
        if self._fd is None:
            return
        self.status_path.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def running(data_dir: Path) -> int:
    """The pid of the server running on ``data_dir``; raises :class:`NoServer` saying
    why there is none."""
    path = data_dir / PID_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NoServer(f"no server runs on {data_dir} (no {PID_FILE})") from None
    try:
        text = os.read(fd, 32).decode(errors="replace").strip()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            if text.isdigit():
                return int(text)
            raise NoServer(f"{path} names no pid: {text!r}") from None
        raise NoServer(f"no server runs on {data_dir} (stale {PID_FILE}, pid {text or '?'})")
    finally:
        os.close(fd)  # and with it the shared lock, if taken


def read_status(data_dir: Path) -> dict[str, Any]:
    """The status the server last wrote (empty if none)."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        status: dict[str, Any] = json.loads((data_dir / STATUS_FILE).read_text())
        return status
    return {}
