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


def test_a_sampled_event_is_logged_once_a_second_with_the_count_not_logged() -> None:
    tenths = [1000]
    with structlog.testing.capture_logs() as captured:
        sampled = logs.Sampled(structlog.get_logger("t"), clock=lambda: tenths[0] / 10)
        for _ in range(25):  # 2.5 s of refusals, ten a second
            sampled.warning("refused", cap=3)
            sampled.warning("other")
            tenths[0] += 1
    refused = [line for line in captured if line["event"] == "refused"]
    assert [line.get("not_logged") for line in refused] == [None, 9, 9]
    assert all(line["cap"] == 3 and line["log_level"] == "warning" for line in refused)
    assert len([line for line in captured if line["event"] == "other"]) == 3
