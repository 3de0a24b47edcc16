"""docker-compose.yml, the Dockerfile and config/haproxy.cfg hold together with the
project (no container engine runs here), and their topology - one Redis, two
tokend nodes, a load balancer - runs as real processes on loopback."""

from __future__ import annotations

import ipaddress
import re
import shlex
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis import asyncio as aioredis

from testkit.clients import RawClient
from testkit.events import EventLog
from testkit.proxies import RoundRobinProxy
from testkit.tokend_process import CALM_CLOCKS, running_nodes
from tokend import config
from tokend.cli import build_parser
from tokend.config import Settings
from tokend.core import protocol as p
from tokend.tokens.service import TokenService

ROOT = Path(__file__).resolve().parent.parent
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
HAPROXY = (ROOT / "config" / "haproxy.cfg").read_text()
# The services that run the tokend image with its default command: the nodes.
NODES = {name: s for name, s in SERVICES.items() if "build" in s and "command" not in s}


def build_of(service: dict[str, Any]) -> dict[str, Any]:
    """The long form of a service's ``build`` (the short form is the context alone)."""
    build = service["build"]
    return {"context": build} if isinstance(build, str) else build


def dockerfile(service: dict[str, Any]) -> Path:
    build = build_of(service)
    return ROOT / build["context"] / build.get("dockerfile", "Dockerfile")


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def image_env(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction, args in dockerfile_instructions(path):
        if instruction == "ENV":
            for item in shlex.split(args):
                name, _, value = item.partition("=")
                env[name] = value
    return env


def test_services_and_the_optional_load_profile():
    assert set(SERVICES) == {"redis", "tokend-a", "tokend-b", "lb", "locust"}
    assert set(NODES) == {"tokend-a", "tokend-b"}
    assert SERVICES["locust"]["profiles"] == ["load"]
    assert all("profiles" not in s for name, s in SERVICES.items() if name != "locust")


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_path_service_and_volume_named_exists(name: str):
    service = SERVICES[name]
    assert "image" in service or "build" in service
    if "build" in service:
        assert dockerfile(service).is_file()
        instructions = dockerfile_instructions(dockerfile(service))
        declared = {args.split("=")[0] for i, args in instructions if i == "ARG"}
        assert set(build_of(service).get("args", {})) <= declared
    for volume in service.get("volumes", []):
        source = volume.split(":")[0]
        if source.startswith("."):
            assert (ROOT / source).exists(), volume
        else:
            assert source in COMPOSE["volumes"], volume
    assert set(service.get("depends_on", [])) <= set(SERVICES)
    assert set(service.get("networks", [])) <= set(COMPOSE["networks"])


@pytest.mark.parametrize("name", [*sorted(NODES), "locust"])
def test_environment_names_real_settings_with_valid_values(name: str):
    env = {**image_env(dockerfile(SERVICES[name])), **SERVICES[name].get("environment", {})}
    names = {config.env_name(field) for field in config.FIELDS}
    assert {key for key in env if key.startswith("TOKEND_")} <= names
    config.load(environ=env)  # raises ConfigError on a bad value


def test_nodes_run_tokend_serve_on_the_port_they_expose():
    instructions = dockerfile_instructions(dockerfile(NODES["tokend-a"]))
    (cmd,) = [yaml.safe_load(args) for i, args in instructions if i == "CMD"]
    assert cmd == ["tokend", "serve"]
    assert build_parser().parse_args(cmd[1:]).command == "serve"
    (expose,) = [args for i, args in instructions if i == "EXPOSE"]
    for name, service in NODES.items():
        env = {**image_env(dockerfile(service)), **service["environment"]}
        assert env["TOKEND_PORT"] == expose, name
        assert env["TOKEND_NODE_NAME"] == name  # events name the container
        assert env["TOKEND_REDIS_URL"].startswith("redis://redis:")
    for instruction, args in instructions:
        if instruction == "COPY":
            *sources, _ = shlex.split(args)
            assert all((ROOT / source).exists() for source in sources), args


def test_locust_runs_the_project_locustfile_through_the_balancer():
    command = SERVICES["locust"]["command"]
    assert (ROOT / command[command.index("-f") + 1]).is_file()
    host = command[command.index("--host") + 1]
    assert host == f"ws://lb:{haproxy_bind_port()}"


def haproxy_bind_port() -> int:
    (port,) = re.findall(r"^\s*bind\s+\S*:(\d+)", HAPROXY, re.MULTILINE)
    return int(port)


def test_haproxy_balances_over_exactly_the_compose_nodes():
    servers = re.findall(r"^\s*server\s+(\S+)\s+([^:\s]+):(\d+)", HAPROXY, re.MULTILINE)
    assert {(host, port) for _, host, port in servers} == {
        (name, service["environment"]["TOKEND_PORT"]) for name, service in NODES.items()
    }
    assert re.search(r"^\s*balance\s+roundrobin", HAPROXY, re.MULTILINE)
    # The check as a client asks: HTTP/1.1 with a Host header (HAProxy's default: 1.0).
    assert re.search(r"^\s*option httpchk$", HAPROXY, re.MULTILINE)
    assert re.search(r"http-check send meth GET uri /readyz ver HTTP/1.1 hdr Host ", HAPROXY)
    # An upgraded connection idles between heartbeats: the tunnel must outlast them.
    (tunnel,) = re.findall(r"timeout tunnel (\d+)s", HAPROXY)
    assert int(tunnel) > Settings().expire_after
    lb = SERVICES["lb"]
    assert f"{haproxy_bind_port()}:{haproxy_bind_port()}" in lb["ports"]
    assert "./config/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in lb["volumes"]


async def test_the_same_topology_on_loopback_survives_a_node_kill(
    make_settings: Callable[..., Settings], tokens: TokenService, redis: aioredis.Redis
):
    """One Redis, the two nodes as processes, a round-robin balancer in front."""
    settings = make_settings(**CALM_CLOCKS)
    token = tokens.mint("behind-the-lb")
    with running_nodes(settings, *sorted(NODES)) as nodes:
        by_name = dict(zip(sorted(NODES), nodes, strict=True))
        async with (
            EventLog(redis, f"{settings.key_prefix}:events") as events,
            RoundRobinProxy([node.port for node in nodes]) as lb,
        ):
            async with RawClient.connect(lb.port) as client:
                tid = str(uuid.UUID(bytes=(welcome := await client.hello(token)).tid))
                await client.heartbeat()
                (started,) = await events.wait_for("SESSION_STARTED", tid)
                held_by = started["node"]
                assert by_name[held_by].kill() == -signal.SIGKILL
                await client.expect_close()  # the balancer passes the drop on
            # The killed node's connection held it live: the proof of its key resumes it
            # at once (spec "Resume proof").
            proof = p.resume_proof(welcome.session_key, welcome.tid)
            async with RawClient.connect(lb.port) as client:
                assert (await client.hello(token, proof)).resumed
                await client.heartbeat()
            (resumed,) = await events.wait_for("SESSION_RESUMED", tid)
    assert resumed["node"] != held_by


def test_nodes_take_client_addresses_from_the_balancer_alone():
    """HAProxy sends PROXY protocol v2 (checks too); each node trusts exactly the
    balancer's fixed address on the compose network, so no other container (nor a
    client) can claim an address."""
    (default_server,) = re.findall(r"^\s*default-server\s+(.*)$", HAPROXY, re.MULTILINE)
    assert {"send-proxy-v2", "check-send-proxy"} <= set(default_server.split())
    lb_address = SERVICES["lb"]["networks"]["edge"]["ipv4_address"]
    (subnet,) = [pool["subnet"] for pool in COMPOSE["networks"]["edge"]["ipam"]["config"]]
    assert ipaddress.ip_address(lb_address) in ipaddress.ip_network(subnet)
    for name, service in NODES.items():
        settings = config.load(environ=service["environment"])
        assert [str(n) for n in settings.proxy_networks] == [f"{lb_address}/32"], name
        assert service["networks"] == ["edge"], name
    assert all("edge" in service["networks"] for service in SERVICES.values())
