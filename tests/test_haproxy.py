"""tokend behind a real HAProxy (Debian's ``haproxy``), as docker-compose.yml deploys it,
on loopback without containers: the shipped config/haproxy.cfg (its Docker parts
swapped for loopback ports, testkit/haproxy.py) in front of three ``tokend serve``
nodes on one Redis, clients from several 127.0.0.x addresses.

Each node must see, log and cap the client's address (PROXY protocol v2 from the
balancer), the balancer's health checks must pass, and a node killed behind the
balancer must leave its sessions resumable through it. The second test runs the
shipped config/haproxy-tls.cfg: HAProxy in TCP mode, TLS at the nodes.

HAProxy is installed with apt-get when missing (as root); where it cannot be, the
tests are skipped with the reason, and fail under ``CI=true`` (testkit/debian.py).
"""

from __future__ import annotations

import contextlib
import itertools
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from redis import asyncio as aioredis
from websockets.exceptions import InvalidStatus

from testkit import debian
from testkit.certificates import Authority, served_serial
from testkit.clients import Closed, RawClient, tid_of
from testkit.events import EventLog
from testkit.haproxy import HAProxy, on_loopback
from testkit.net import LOOPBACK
from testkit.tokend_process import CALM_CLOCKS, TokendProcess, running_nodes
from testkit.waiting import eventually
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.tokens.service import TokenService

ROOT = Path(__file__).resolve().parent.parent
NODES = ("node-a", "node-b", "node-c")
# Client addresses: every 127/8 address is this host's; the balancer reaches the
# nodes from 127.0.0.1, the only address they trust with a PROXY header.
SOURCES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
NEWCOMER = "127.0.0.5"
CHECK_INTERVAL_MS = 200


@pytest.fixture(scope="module")
def haproxy_binary() -> Path:
    return debian.require("haproxy", "haproxy")


@contextlib.contextmanager
def balancer(
    binary: Path, directory: Path, shipped: str, nodes: Sequence[TokendProcess]
) -> Iterator[HAProxy]:
    """HAProxy running ``config/<shipped>`` on loopback, in front of ``nodes``."""
    lb = HAProxy(binary, directory)
    text = (ROOT / "config" / shipped).read_text()
    servers = {name: node.port for name, node in zip(NODES, nodes, strict=False)}
    lb.start(on_loopback(text, lb.port, servers, lb.stats_socket, CHECK_INTERVAL_MS))
    try:
        yield lb
    finally:
        lb.stop()


def checks_passed(lb: HAProxy, names: Sequence[str]) -> bool:
    """Every server UP, its last HTTP check passed (L7OK: a PROXY header, then GET
    /readyz over HTTP/1.1, answered 200)."""
    servers = lb.servers()
    return all(
        servers[f"tokend_nodes/{name}"]["status"] == "UP"
        and servers[f"tokend_nodes/{name}"]["check_status"] == "L7OK"
        for name in names
    )


async def checked_up(lb: HAProxy, names: Sequence[str]) -> None:
    await eventually(lambda: checks_passed(lb, names), timeout=15, what="every server checked UP")


async def resume(port: int, source: str, token: str, proof: bytes) -> int | None:
    """Connect through the balancer, resume the session and heartbeat; the client's
    port. None if HAProxy answered 503 (no server it can reach), to be tried again.

    With the resume proof of the last WELCOME's key, as the SDKs send it: the killed
    node's connection held the session live, and only a proof takes it at once
    (spec "Resume proof"; without one, 4509 until the session has been silent)."""
    try:
        async with RawClient.connect(port, source=source) as client:
            assert (await client.hello(token, proof)).resumed
            await client.heartbeat()
            return client_port(client)
    except InvalidStatus as refused:
        if refused.response.status_code != 503:
            raise
        return None


async def logged_for(
    nodes: Sequence[TokendProcess], event: str, tid: str
) -> tuple[TokendProcess, dict[str, Any]]:
    """The node that logged ``event`` about session ``tid``, and the line."""

    def find() -> tuple[TokendProcess, dict[str, Any]] | None:
        for node in nodes:
            for line in node.logged(event):
                if line.get("tid") == tid:
                    return node, line
        return None

    return await eventually(find, timeout=10, what=f"{event} logged for {tid}")


def client_port(client: RawClient) -> int:
    return int(client.ws.transport.get_extra_info("sockname")[1])


def peers_logged(nodes: Sequence[TokendProcess]) -> dict[str, set[str]]:
    """The addresses each kind of line names as its peer."""
    peers: dict[str, set[str]] = {}
    for line in (line for node in nodes for line in node.log_lines if "peer" in line):
        peers.setdefault(line["event"], set()).add(line["peer"].rpartition(":")[0])
    return peers


async def test_behind_haproxy_each_node_sees_caps_and_resumes_the_clients(
    make_settings: Callable[..., Settings],
    tokens: TokenService,
    redis: aioredis.Redis,
    haproxy_binary: Path,
    tmp_path: Path,
) -> None:
    settings = make_settings(
        **CALM_CLOCKS,
        proxy_protocol_from=LOOPBACK,
        max_connections_per_ip=1,
        log_level="debug",  # "session started" carries the session's peer
    )
    with (
        running_nodes(settings, *NODES) as nodes,
        balancer(haproxy_binary, tmp_path, "haproxy.cfg", nodes) as lb,
    ):
        by_name = dict(zip(NODES, nodes, strict=True))
        await checked_up(lb, NODES)
        async with (
            EventLog(redis, f"{settings.key_prefix}:events") as events,
            contextlib.AsyncExitStack() as sessions,
        ):
            # Each client's address, port included, in the log of the node holding it.
            held: dict[str, tuple[RawClient, str, str]] = {}  # source -> client, token, tid
            for source in SOURCES:
                client = await sessions.enter_async_context(
                    RawClient.connect(lb.port, source=source)
                )
                token = tokens.mint(f"sub-{source}")
                tid = tid_of(await client.hello(token))
                await client.heartbeat()
                _, line = await logged_for(nodes, "session started", tid)
                assert line["peer"] == f"{source}:{client_port(client)}"
                held[source] = (client, token, tid)
            starts = [(await events.wait_for("SESSION_STARTED", t))[0] for _, _, t in held.values()]
            assert {event["node"] for event in starts} == set(NODES)  # round robin
            # Never the balancer's 127.0.0.1 (its health checks log nothing).
            assert peers_logged(nodes) == {"session started": set(SOURCES)}

            # The cap (1 per address per node) applies per client address.
            async with contextlib.AsyncExitStack() as more:
                with pytest.raises(InvalidStatus) as over:
                    for _ in NODES:  # the next node that holds one of 127.0.0.2's refuses
                        await more.enter_async_context(
                            RawClient.connect(lb.port, source=SOURCES[0])
                        )
                assert over.value.response.status_code == 429
                refusals = [
                    line
                    for node in nodes
                    for line in node.logged("handshake refused: connections per IP")
                ]
                assert [line["peer"] for line in refusals] == [SOURCES[0]]
                newcomer = await more.enter_async_context(
                    RawClient.connect(lb.port, source=NEWCOMER)
                )
                await newcomer.hello(tokens.mint("newcomer"))

            # A node killed behind the balancer: its session resumes on another through it.
            source = SOURCES[1]
            client, token, tid = held[source]
            assert client.welcome is not None
            proof = p.resume_proof(client.welcome.session_key, client.welcome.tid)
            victim = next(e["node"] for e in starts if e["tid"] == tid)
            assert by_name[victim].kill() == -signal.SIGKILL
            assert isinstance(await client.expect_close(), Closed)
            port = await eventually(
                lambda: resume(lb.port, source, token, proof), timeout=10, what="resumed"
            )
            node, line = await logged_for(nodes, "session resumed", tid)
            assert line["peer"] == f"{source}:{port}"
            (resumed,) = await events.wait_for("SESSION_RESUMED", tid)
            assert resumed["node"] != victim and node is by_name[resumed["node"]]
            for survivor, _, _ in (held[s] for s in SOURCES if s != source):
                await survivor.heartbeat()  # the other nodes' sessions go on untouched
        survivors = [name for name in NODES if name != victim]
        # Never marked DOWN while one node died (HAProxy's count of UP -> DOWN), and passing
        # their checks: a check that a busy machine made late counts only once ("UP 1/2").
        servers = lb.servers()
        assert [servers[f"tokend_nodes/{name}"]["chkdown"] for name in survivors] == ["0", "0"]
        await eventually(lambda: checks_passed(lb, survivors), timeout=10, what="checks passed")
        await eventually(lambda: lb.servers()[f"tokend_nodes/{victim}"]["status"] == "DOWN")


async def test_tls_at_the_nodes_behind_haproxy_in_tcp_mode(
    make_settings: Callable[..., Settings],
    tokens: TokenService,
    haproxy_binary: Path,
    tmp_path: Path,
) -> None:
    """config/haproxy-tls.cfg: TCP mode, a PROXY v2 header then the client's own TLS
    session with the node (checks: a header, then TLS, then GET /readyz)."""
    authority = Authority.create()
    cert_file, key_file = authority.issue(tmp_path / "cert.pem", tmp_path / "key.pem", serial=7)
    trusting = authority.client_context(tmp_path / "ca.pem")
    settings = make_settings(
        **CALM_CLOCKS,
        proxy_protocol_from=LOOPBACK,
        tls_cert_file=str(cert_file),
        tls_key_file=str(key_file),
        log_level="debug",
    )
    with (
        running_nodes(settings, *NODES[:2]) as nodes,
        balancer(haproxy_binary, tmp_path, "haproxy-tls.cfg", nodes) as lb,
    ):
        await checked_up(lb, NODES[:2])
        for source in itertools.islice(itertools.cycle(SOURCES[:2]), 4):  # both nodes, twice
            async with RawClient.connect(lb.port, source=source, ssl=trusting) as client:
                assert served_serial(client.ws.transport.get_extra_info("ssl_object")) == 7
                tid = tid_of(await client.hello(tokens.mint(f"tls-{source}")))
                await client.heartbeat()
                _, line = await logged_for(nodes, "session started", tid)
                assert line["peer"] == f"{source}:{client_port(client)}"
        assert all(node.logged("session started") for node in nodes)
        assert peers_logged(nodes) == {
            "session started": set(SOURCES[:2]),
            "connection closed by client": set(SOURCES[:2]),
        }
