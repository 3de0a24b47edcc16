"""Fixtures: a private redis-server per test session, tokend apps with short clocks
(testkit.tokend_process.SHORT_CLOCKS)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
import structlog.testing
from redis import asyncio as aioredis

from testkit.events import EventLog
from testkit.redis_servers import RedisClusterProcess, RedisProcess
from testkit.tokend_process import SHORT_CLOCKS
from testkit.tokens import WallClockTokens, minter
from tokend import config, logs
from tokend.config import Settings
from tokend.edge import tls
from tokend.ops import app as server
from tokend.ops.app import App
from tokend.server import admission, drain, link
from tokend.store.keyspace import Keyspace
from tokend.store.redis_client import Client, open_client

logs.configure("console", "warning")


# Tests that run twice: on one Redis, and with every app and client on a local Redis
# Cluster of three masters (docs/scaling.md), unchanged; their ids end in [cluster].
ON_A_CLUSTER_TOO = frozenset(
    {
        "test_cli.py::test_unused_tid_revoked_is_barred",
        "test_events.py::test_durable_acks_after_the_body_and_claims_what_a_crashed_consumer_left",
        "test_events.py::test_durable_redelivers_own_pending_after_a_restart_and_can_start_at_the_end",
        "test_events.py::test_from_start_replays_what_the_streams_hold",
        "test_history.py::test_two_nodes_see_each_other_and_the_same_cluster_counts",
        "test_server.py::test_bye_closes_1000_and_leaves_tombstone",
        "test_server.py::test_hello_welcome_and_heartbeat_ack",
        "test_server.py::test_renewal_inside_window",
        "test_server.py::test_revoke_closes_connection_and_bars_token",
        "test_server.py::test_silence_expires_once",
        "test_server.py::test_takeover_closes_older_connection",
        "test_server.py::test_warn_notice_then_recovery",
    }
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if f"{metafunc.definition.path.name}::{metafunc.definition.originalname}" in ON_A_CLUSTER_TOO:
        metafunc.parametrize("redis_server", ["single", "cluster"], indirect=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test of :data:`ON_A_CLUSTER_TOO` renamed or gone is an error, not a test less."""
    files = {item.path.name for item in items}
    found = {
        f"{item.path.name}::{item.originalname}"
        for item in items
        if isinstance(item, pytest.Function)
    }
    lost = sorted(n for n in ON_A_CLUSTER_TOO - found if n.split("::")[0] in files)
    if lost:
        raise pytest.UsageError(f"ON_A_CLUSTER_TOO names tests that do not exist: {lost}")


@pytest.fixture(scope="session")
def redis_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisProcess | RedisClusterProcess]:
    """The Redis of every test: one redis-server, or a Redis Cluster for the tests of
    :data:`ON_A_CLUSTER_TOO` on their second run."""
    if getattr(request, "param", "single") == "cluster":
        server: RedisProcess | RedisClusterProcess = RedisClusterProcess(
            tmp_path_factory.mktemp("cluster")
        )
    else:
        server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A Redis of this test alone, persisting to an AOF so that it can be killed."""
    server = RedisProcess(tmp_path / "own-redis", aof=True)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def home(tmp_path: Path) -> dict[str, str]:
    """A fresh HOME, so the default data dir (~/.local/share/tokend) is empty."""
    return {"HOME": str(tmp_path / "home"), "XDG_DATA_HOME": ""}


@pytest.fixture
def keys(settings: Settings) -> Keyspace:
    """The key names of this test's prefix."""
    return Keyspace(settings.key_prefix)


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    return tmp_path / "keys"


@pytest.fixture
def make_settings(
    redis_server: RedisProcess, keys_dir: Path, tmp_path: Path
) -> Callable[..., Settings]:
    """Settings on the test Redis, with a key prefix of this test's own."""
    prefix = "t" + uuid.uuid4().hex[:12]

    def make(**overrides: Any) -> Settings:
        values = {
            "redis_url": redis_server.url,
            "key_prefix": prefix,
            "keys_dir": str(keys_dir),
            "data_dir": str(tmp_path / "data"),
            "port": 0,
            "admin_port": 0,
            "node_name": "node-a",
            **SHORT_CLOCKS,
            **overrides,
        }
        return config.load(values, environ={})

    return make


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    return make_settings()


@pytest.fixture
def tokens(settings: Settings) -> WallClockTokens:
    return minter(settings)


@pytest.fixture
async def start_app(
    make_settings: Callable[..., Settings],
) -> AsyncIterator[Callable[..., Awaitable[App]]]:
    """Start tokend apps in this event loop (real sockets); all stopped at teardown."""
    apps: list[App] = []

    async def start(**overrides: Any) -> App:
        app = App(make_settings(**overrides))
        await app.start()
        apps.append(app)
        return app

    yield start
    for app in apps:
        await app.stop()


@pytest.fixture
async def app(start_app: Callable[..., Awaitable[App]]) -> App:
    return await start_app()


@pytest.fixture
def tokend_logs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[MutableMapping[str, Any]]]:
    """The warning-and-above lines of the listener, its admission, drain, connections
    and TLS, captured for the whole test (the modules' loggers made anew: loggers cached
    before a capture, as tokend.logs configures them, would not see it)."""
    loggers = (
        (server, "log"),
        (admission, "log"),
        (drain, "log"),
        (link, "_log"),
        (tls, "log"),
    )
    with structlog.testing.capture_logs() as logs:
        for module, name in loggers:
            monkeypatch.setattr(module, name, structlog.get_logger(module.__name__))
        yield logs


@pytest.fixture
async def redis(redis_server: RedisProcess | RedisClusterProcess) -> AsyncIterator[Client]:
    """A client of the test's Redis (of a cluster: as tokend makes one)."""
    if isinstance(redis_server, RedisClusterProcess):
        client: Client = open_client(redis_server.url, config.load({}, environ={}))
    else:
        client = aioredis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def events(redis: aioredis.Redis, settings: Settings) -> AsyncIterator[EventLog]:
    async with EventLog(redis, f"{settings.key_prefix}:events") as log:
        yield log
