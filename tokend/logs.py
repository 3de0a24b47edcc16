"""structlog configuration, done once per process: JSON lines on stderr, or lines for a
person to read (structlog's ConsoleRenderer); by default the latter when stderr is a
terminal.

Every line names its logger (``get_logger``'s name) and, once :func:`serving_as` was
called, the node it was logged for: no module binds the node name itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import structlog


class StderrLogger:
    """Writes each line to ``sys.stderr`` as it is now, in one write.

    One write per line (print() makes two): the workers of `serve --workers` share
    stderr, and a pipe keeps writes up to PIPE_BUF (4 KiB) whole. Looked up at each
    write rather than kept, so that a stream replaced later (as pytest does) is followed.
    Made by ``structlog.get_logger(name)``, it keeps the name for :func:`_add_logger_name`.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name

    def msg(self, message: str) -> None:
        stream = sys.stderr
        try:
            stream.write(message + "\n")
            stream.flush()
        except (OSError, ValueError):
            # Whatever read the log is gone (a broken pipe, a closed stream): this line
            # and the later ones are lost, and the process serves, reloads and stops on.
            _discard_stderr(stream)

    debug = info = warning = warn = error = critical = exception = fatal = failure = log = msg


def _discard_stderr(stream: Any) -> None:
    """Point the file descriptor under ``stream`` at /dev/null, so that every later write
    to it succeeds: this logger's, the standard library's, and the interpreter's last
    flush at exit (which would otherwise turn a clean exit into status 120)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


class Sampled:
    """At most one line a second per event, for what an overload repeats thousands of times
    a second (refused handshakes): the first at once, each next one with the count of
    those not logged since (``not_logged``). A line per refusal would spend the CPU the
    overload lacks on logging it."""

    INTERVAL = 1.0

    def __init__(self, logger: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.clock = clock
        self.last: dict[str, tuple[float, int]] = {}  # event -> (logged at, not logged since)

    def warning(self, event: str, **fields: Any) -> None:
        now = self.clock()
        logged_at, not_logged = self.last.get(event, (-self.INTERVAL, 0))
        if now - logged_at < self.INTERVAL:
            self.last[event] = (logged_at, not_logged + 1)
            return
        self.last[event] = (now, 0)
        if not_logged:
            fields["not_logged"] = not_logged
        self.logger.warning(event, **fields)


def configure(fmt: str = "", level: str = "info") -> None:
    """``fmt`` "json" or "console"; empty: console when stderr is a terminal (a person
    reads it), JSON otherwise (a collector does)."""
    console = fmt == "console" or (not fmt and sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if console
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,  # the node (serving_as)
            structlog.processors.add_log_level,
            _add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=StderrLogger,
        cache_logger_on_first_use=True,
    )
    # websockets and redis log through the standard library; keep them quiet but visible.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s %(message)s")


def serving_as(node: str) -> None:
    """Name ``node`` in every line logged from now on by this task and by the tasks,
    callbacks and connections it starts (one node per process but in tests)."""
    structlog.contextvars.bind_contextvars(node=node)


def _add_logger_name(
    logger: StderrLogger, method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    if logger.name:
        event_dict.setdefault("logger", logger.name)
    return event_dict


def redact_url(url: str) -> str:
    """``url`` fit for a log line: its password (``user:password@`` or ``?password=``)
    replaced by ``***``."""
    userinfo, at, _ = urlsplit(url).netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if at and colon:
        url = url.replace(userinfo + "@", f"{user}:***@", 1)
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", url)
