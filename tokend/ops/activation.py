"""Socket activation and readiness notification: systemd's conventions, from both sides.

A process that serves may inherit its listening sockets from the one that started it
(sd_listen_fds(3): ``LISTEN_FDS`` descriptors from fd 3, ``LISTEN_PID`` naming the
process they are for, ``LISTEN_FDNAMES`` their names) and report its state to it
(sd_notify(3): ``KEY=VALUE`` lines in one datagram to the unix socket ``NOTIFY_SOCKET``).
``tokend serve`` takes both from systemd (a ``.socket`` unit, ``Type=notify``), and
the workers of ``tokend serve --workers N`` take both from their supervisor
(tokend/ops/supervisor.py), which plays systemd's part: it holds the sockets across worker
restarts and starts each worker through :func:`activated_command`.

Only the standard library, at the top level: this file also runs on its own, as the step
between fork and exec of a child (``python -I -S activation.py ...``), where no package
is importable.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

# sd_listen_fds(3): the first inherited descriptor.
LISTEN_FDS_START = 3
LISTEN_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# The name (LISTEN_FDNAMES, systemd's FileDescriptorName=) of an inherited admin
# listener; a socket of any other name is the main (WebSocket) listener, but for
# SUPERVISOR.
ADMIN = "admin"
# The name of a worker's end of the socketpair its supervisor made for the two of them
# (tokend/ops/supervisor.py): not a listener; the supervisor sends the reload's handoff
# sockets over it, and the worker reports its handoff on it.
SUPERVISOR = "supervisor"
# sd_listen_fds(3): the name of a descriptor that LISTEN_FDNAMES does not name.
UNNAMED = "unknown"
# tokend's own additions, between a supervisor and its workers. A notification field
# (sd_notify(3) asks for an X_ prefix): a stopping server's drain has closed all its
# connections. A signal to a worker whose slot has a new worker: stop accepting, and
# keep serving the open connections until SIGTERM.
DRAINED = "X_TOKEND_DRAINED"
STOP_ACCEPTING = signal.SIGUSR1
# On the supervisor's channel: to a reload's new worker, HANDOFF=take with the socket to
# take connections from; to the old one, HANDOFF=give with the other end and TO=<the new
# worker's node name>. The old one answers HANDED=<JSON: moved, fell_back by reason>.
HANDOFF = "HANDOFF"
HANDED = "HANDED"
# To an old worker whose new one died before the reload's drain: ACCEPT=1, serve the
# slot again.
ACCEPT = "ACCEPT"
# The most a notification datagram may hold; systemd reads at most this much.
MAX_NOTIFICATION = 4096
_PR_SET_PDEATHSIG = 1


class ActivationError(ValueError):
    """Inherited descriptors or variables that cannot be used; the message says which."""


# Inheriting listening sockets (sd_listen_fds(3))


def listen_fds(environ: Mapping[str, str], pid: int) -> list[tuple[int, str]]:
    """The descriptors ``environ`` passes to process ``pid``, with their names.

    None unless ``LISTEN_PID`` is ``pid``: the variables of a process's parent are not
    for it. Names come from ``LISTEN_FDNAMES`` (colon-separated), else ``unknown``.
    """
    if "LISTEN_FDS" not in environ or environ.get("LISTEN_PID") != str(pid):
        return []
    count_text = environ["LISTEN_FDS"]
    if not count_text.isascii() or not count_text.isdigit():
        raise ActivationError(f"LISTEN_FDS: not a number of descriptors: {count_text!r}")
    count = int(count_text)
    names = environ["LISTEN_FDNAMES"].split(":") if "LISTEN_FDNAMES" in environ else []
    if names and len(names) != count:
        raise ActivationError(f"LISTEN_FDNAMES: {len(names)} names for {count} descriptors")
    return [(LISTEN_FDS_START + i, names[i] if names else UNNAMED) for i in range(count)]


def sort_listeners(fds: Sequence[tuple[int, str]]) -> tuple[int | None, int | None]:
    """(main, admin): which inherited descriptor serves which listener.

    The one named ``admin`` serves the admin listener; the other one, whatever its name
    (systemd names it after the socket unit by default), the WebSocket port.
    """
    admin = [fd for fd, name in fds if name == ADMIN]
    main = [fd for fd, name in fds if name != ADMIN]
    if len(admin) > 1 or len(main) > 1:
        names = ", ".join(name for _, name in fds)
        raise ActivationError(
            f"inherited sockets: expected one listener and at most one named {ADMIN!r}, "
            f"got {len(fds)} ({names})"
        )
    return (main[0] if main else None, admin[0] if admin else None)


@dataclass(frozen=True, slots=True)
class Inherited:
    """The listening sockets a process was given; None where it binds its own."""

    main: socket.socket | None = None
    admin: socket.socket | None = None
    supervisor: socket.socket | None = None  # a worker's channel to its supervisor


def adopt(fd: int) -> socket.socket:
    """A listening stream socket of an inherited descriptor, closed on exec (as
    sd_listen_fds(3) leaves it): this process's children must not hold it."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ActivationError(f"inherited descriptor {fd}: {exc.strerror}") from None
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_ACCEPTCONN
    ):
        sock.detach()
        raise ActivationError(f"inherited descriptor {fd}: not a listening stream socket")
    sock.set_inheritable(False)
    return sock


def take_inherited(environ: MutableMapping[str, str] | None = None) -> Inherited:
    """Adopt the listening sockets this process inherited, once: the ``LISTEN_*``
    variables are removed, so that neither a second call nor a child sees them."""
    environ = os.environ if environ is None else environ
    fds = listen_fds(environ, os.getpid())
    for name in LISTEN_VARIABLES:
        environ.pop(name, None)
    channel = [fd for fd, name in fds if name == SUPERVISOR]
    main, admin = sort_listeners([(fd, name) for fd, name in fds if name != SUPERVISOR])
    return Inherited(
        main=adopt(main) if main is not None else None,
        admin=adopt(admin) if admin is not None else None,
        supervisor=adopt_channel(channel[0]) if channel else None,
    )


def adopt_channel(fd: int) -> socket.socket:
    """The worker's end of its supervisor's socketpair (SOCK_SEQPACKET), closed on exec."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ActivationError(f"inherited descriptor {fd}: {exc.strerror}") from None
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
        sock.detach()
        raise ActivationError(f"inherited descriptor {fd}: not the supervisor's socketpair")
    sock.set_inheritable(False)
    sock.setblocking(False)
    return sock


# Readiness and state (sd_notify(3))


def notification(fields: Mapping[str, str]) -> bytes:
    """One notification datagram: ``KEY=VALUE`` lines."""
    return "".join(f"{key}={value}\n" for key, value in fields.items()).encode()


def parse_notification(data: bytes) -> dict[str, str]:
    """The fields of a notification datagram (lines without ``=`` are ignored)."""
    fields = {}
    for line in data.decode(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields


def socket_address(name: str) -> str:
    """The address of ``NOTIFY_SOCKET``: a path, or ``@name`` in the abstract namespace."""
    return "\0" + name[1:] if name.startswith("@") else name


def monotonic_usec() -> str:
    """``MONOTONIC_USEC`` of a ``RELOADING=1`` notification: CLOCK_MONOTONIC in µs."""
    return str(time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)


class Notifier:
    """Sends this process's state to whoever started it, if it asked (``NOTIFY_SOCKET``)."""

    def __init__(self, address: str | None) -> None:
        self.address = address

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """The notifier ``NOTIFY_SOCKET`` names; the variable is removed, so that the
        process's children (the embedded Redis) do not report in its name."""
        environ = os.environ if environ is None else environ
        name = environ.pop("NOTIFY_SOCKET", "")
        return cls(socket_address(name) if name else None)

    def notify(self, **fields: str) -> None:
        """Send ``fields`` (``READY="1"``, ``STATUS=...``); nothing when nobody asked.

        A manager that has gone away is not this process's problem: errors are ignored,
        as sd_notify(3) callers do.
        """
        if self.address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(notification(fields), self.address)
        except OSError:
            pass


def notify_listener(address: str) -> socket.socket:
    """The manager's end: a datagram socket at ``address`` that receives each sender's
    credentials (SO_PASSCRED), so that a notification is known by its sender's pid."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.bind(socket_address(address))
    sock.setblocking(False)
    return sock


_UCRED = "iII"  # struct ucred: pid, uid, gid


def receive_notification(sock: socket.socket) -> tuple[int, dict[str, str]] | None:
    """One datagram from a :func:`notify_listener` socket: (sender pid, fields); None
    when nothing waits."""
    size = struct.calcsize(_UCRED)
    try:
        data, ancillary, _, _ = sock.recvmsg(MAX_NOTIFICATION, socket.CMSG_SPACE(size))
    except BlockingIOError:
        return None
    pid = 0
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack(_UCRED, payload[:size])[0]
    return pid, parse_notification(data)


# The supervisor's channel to a worker (a SOCK_SEQPACKET socketpair): notification-style
# messages (KEY=VALUE lines), each with at most one descriptor beside it.


def send_message(sock: socket.socket, fields: Mapping[str, str], fd: int | None = None) -> None:
    """One message on a channel, with ``fd`` beside it (SCM_RIGHTS) if given."""
    socket.send_fds(sock, [notification(fields)], [fd] if fd is not None else [])


def receive_message(sock: socket.socket) -> tuple[dict[str, str], list[int]] | None:
    """One message from a channel and the descriptors beside it; None when nothing waits.
    An empty dict: the other end closed."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_NOTIFICATION, 1)
    except BlockingIOError:
        return None
    return parse_notification(data), fds


# Starting a process with sockets (the manager's side of sd_listen_fds(3))


def die_with_parent() -> None:
    """Have this process sent SIGTERM when its parent dies, even by SIGKILL (the
    setting survives exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def activated_command(
    command: Sequence[str], sockets: Sequence[tuple[socket.socket, str]]
) -> tuple[list[str], tuple[int, ...]]:
    """The argv and the ``pass_fds`` of a :class:`subprocess.Popen` that runs ``command``
    with ``sockets`` (each with its name) as systemd would pass them, and that dies with
    the process calling this.

    Popen cannot do it alone: the descriptors must arrive at 3, 4, ... and
    ``LISTEN_PID`` must be the child's own pid, known only after the fork. So the child
    first runs this file (``python -I -S``: no site packages), which does what systemd does
    between fork and exec, then execs ``command`` in the same process.
    """
    fds = tuple(sock.fileno() for sock, _ in sockets)
    names = ":".join(name for _, name in sockets)
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), names]
    return [*argv, ",".join(map(str, fds)), *command], fds


def _exec_activated(argv: Sequence[str]) -> NoReturn:
    """``PARENT NAMES FDS COMMAND...``: die with PARENT, move FDS (comma-separated) to
    3, 4, ... named NAMES (colon-separated), set the ``LISTEN_*`` variables for this
    pid, and exec COMMAND."""
    parent, names, fds_text, *command = argv
    die_with_parent()
    if os.getppid() != int(parent):
        sys.exit("tokend: the process that started this one has exited")
    fds = [int(fd) for fd in fds_text.split(",")] if fds_text else []
    # Copies above the target range first: a source may sit at a target's number.
    copies = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, LISTEN_FDS_START + len(fds)) for fd in fds]
    for fd in fds:
        os.close(fd)
    for i, copy in enumerate(copies):
        os.dup2(copy, LISTEN_FDS_START + i)  # inheritable; the copies close on exec
    os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=names)
    if not fds:
        del os.environ["LISTEN_FDNAMES"]  # no names for no descriptors
    signal.pthread_sigmask(signal.SIG_SETMASK, set())  # a service starts with none blocked
    os.execv(command[0], command)


if __name__ == "__main__":
    _exec_activated(sys.argv[1:])
