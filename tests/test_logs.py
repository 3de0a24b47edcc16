"""Log lines: each names its logger and, once a node serves, the node (tokend.logs)."""

from __future__ import annotations

import asyncio
import json

import pytest
import structlog

from tokend import logs


def test_a_line_names_its_logger_and_the_node_it_was_logged_for(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = structlog.get_logger("tokend.test")

    async def serve() -> None:
        logs.serving_as("node-t")
        log.info("serving")
        # What the serving task starts logs for its node too.
        await asyncio.create_task(_log_in_task(log))

    logs.configure("json", "info")
    try:
        asyncio.run(serve())
        log.info("elsewhere", node="given")
    finally:
        logs.configure("console", "warning")  # as tests/conftest.py does
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(e["event"], e["logger"], e.get("node")) for e in lines] == [
        ("serving", "tokend.test", "node-t"),
        ("in a task", "tokend.test", "node-t"),
        ("elsewhere", "tokend.test", "given"),
    ]


async def _log_in_task(log: structlog.typing.FilteringBoundLogger) -> None:
    log.info("in a task")
