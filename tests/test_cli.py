"""The `tokend` command as a newcomer runs it: real processes, embedded Redis."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import signal
import sys
import uuid
from pathlib import Path

import pytest
import redis as redis_lib

from testkit.clients import RawClient
from testkit.net import http_get
from testkit.tokend_process import CLEAN_ENV, TokendProcess, tokend
from testkit.tokens import WallClockTokens, minter
from testkit.waiting import eventually
from tokend import config
from tokend.cli import COMMAND_SETTINGS
from tokend.core import protocol as p
from tokend.store.keyspace import Keyspace
from tokend.store.sessions import proof_digest


def verifier(data_dir: Path) -> WallClockTokens:
    settings = config.load({"data_dir": str(data_dir)}, environ={})
    return minter(settings)


def test_issue_prints_only_a_verifiable_token(home: dict[str, str], tmp_path: Path):
    result = tokend("issue", "--sub", "alice", "--prio", "7", env=home)
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip()
    assert result.stdout == token + "\n"
    claims = verifier(tmp_path / "home/.local/share/tokend").verify(token)
    assert claims.sub == "alice" and claims.prio == 7
    assert claims.exp - claims.iat == 900


def test_issue_count_mints_numbered_subjects(home: dict[str, str], tmp_path: Path):
    result = tokend("issue", "--sub", "load", "--count", "500", "--ttl", "60", env=home)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    service = verifier(tmp_path / "home/.local/share/tokend")
    claims = [service.verify(line) for line in lines]
    assert [c.sub for c in claims] == [f"load-{n}" for n in range(1, 501)]
    assert len({c.tid for c in claims}) == 500


def test_help_explains_each_command():
    result = tokend("--help", env={})
    assert result.returncode == 0
    for command in ("serve", "issue", "events", "revoke", "keys"):
        assert command in result.stdout


def setting_flags(help_text: str) -> set[str]:
    """The flags of the help's "... settings" sections."""
    sections = re.split(r"^\S.* settings:$", help_text, flags=re.M)[1:]
    return {flag for text in sections for flag in re.findall(r"^  (--[a-z-]+) [A-Z]+", text, re.M)}


@pytest.mark.parametrize("command", list(COMMAND_SETTINGS))
def test_each_command_shows_the_settings_it_reads_each_with_its_meaning(command: str):
    shown = tokend(command, "--help", env={"COLUMNS": "1000"})
    assert shown.returncode == 0
    flags = setting_flags(shown.stdout)
    assert flags == {"--" + name.replace("_", "-") for name in COMMAND_SETTINGS[command]}
    for name in COMMAND_SETTINGS[command]:
        assert config.meaning(name) in shown.stdout
    if command != "serve":  # nothing of the server's own: its clocks, listener, limits
        assert not flags & {"--warn-after", "--max-frame-rate", "--admin-port", "--workers"}
    if command in ("issue", "keys"):  # the keys directory alone
        assert "--redis-url" not in flags


def test_a_missing_argument_is_one_line():
    refused = tokend("revoke", env={})
    assert refused.returncode == 2
    assert refused.stderr == (
        "tokend revoke: the following arguments are required: tid (see tokend revoke --help)\n"
    )


def test_connect_refuses_tls_options_it_cannot_use_in_one_line(tmp_path: Path):
    token = minter(config.load({"data_dir": str(tmp_path)}, environ={})).mint("tls")
    missing = str(tmp_path / "no-such-ca.pem")
    for url, error in (
        ("ws://127.0.0.1:9/v1/ws", "ca_file and ssl are for wss:// URLs"),
        ("wss://127.0.0.1:9/v1/ws", "No such file or directory"),
    ):
        refused = tokend("connect", "--token", token, "--url", url, "--ca-file", missing, env={})
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.startswith("tokend connect: ") and error in refused.stderr
        assert refused.stderr.count("\n") == 1


async def test_serve_embedded_default_then_revoke_and_events(home: dict[str, str], tmp_path: Path):
    data_dir = tmp_path / "home/.local/share/tokend"
    server = TokendProcess({**CLEAN_ENV, **home})
    server.start()
    events_proc = None
    try:
        assert await http_get(server.port, "/readyz") == (200, {"status": "ready"})
        assert (data_dir / "redis.sock").exists()
        assert (data_dir / "keys").stat().st_mode & 0o777 == 0o700

        token = tokend("issue", "--sub", "newcomer", env=home).stdout.strip()
        tid = str(verifier(data_dir).verify(token).tid)
        async with RawClient.connect(server.port) as client:
            await client.hello(token)
            await client.heartbeat()
            revoked = await asyncio.to_thread(tokend, "revoke", tid, env=home)
            assert revoked.returncode == 0, revoked.stderr
            assert (await client.expect_close()).code == p.CloseCode.TOKEN_REVOKED

        events_proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tokend",
            "events",
            "--from-start",
            env={**CLEAN_ENV, **home},
            stdout=asyncio.subprocess.PIPE,
        )
        assert events_proc.stdout is not None
        seen = []
        async with asyncio.timeout(15):
            while "TOKEN_REVOKED" not in seen:
                event = json.loads(await events_proc.stdout.readline())
                assert event["tid"] == tid
                seen.append(event["type"])
        assert seen == ["SESSION_STARTED", "TOKEN_REVOKED"]
    finally:
        if events_proc is not None:
            with contextlib.suppress(ProcessLookupError):
                events_proc.kill()
            await events_proc.wait()
        assert server.stop(signal.SIGTERM) == 0
    # The embedded redis-server went away with tokend.
    assert not (data_dir / "redis.sock").exists() or not _answers(data_dir / "redis.sock")


def _answers(sock: Path) -> bool:
    import redis

    try:
        return bool(redis.Redis(unix_socket_path=str(sock), socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def test_bad_setting_stops_startup_with_one_line(home: dict[str, str]):
    result = tokend("serve", env={**home, "TOKEND_EXPIRE_AFTER": "-1"})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "expire_after" in result.stderr


def test_revoke_rejects_non_uuid(home: dict[str, str]):
    result = tokend("revoke", "not-a-uuid", env=home)
    assert result.returncode == 2 and "UUID" in result.stderr


def test_unused_tid_revoked_is_barred(home: dict[str, str], redis_server):
    tid = str(uuid.uuid4())
    env = {**home, "TOKEND_REDIS_URL": redis_server.url, "TOKEND_KEY_PREFIX": "clirevoke"}
    result = tokend("revoke", tid, env=env)
    assert result.returncode == 0 and "no live session" in result.stdout
    again = tokend("revoke", tid, env=env)
    assert again.returncode == 0 and "already ended" in again.stdout


async def test_tokens_never_logged(home: dict[str, str], tmp_path: Path):
    data_dir = tmp_path / "home/.local/share/tokend"
    server = TokendProcess(
        {
            **CLEAN_ENV,
            **home,
            "TOKEND_LOG_LEVEL": "debug",
            "TOKEND_TOKEN_TTL": "10",
            "TOKEND_RENEW_WINDOW": "9",
        }
    )
    server.start()
    service = verifier(data_dir)
    good = service.mint("loggy", ttl_s=5)
    forged = good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB")
    renewed = ""
    secrets: list[bytes] = []  # session keys and resume proofs, and wrong ones
    try:
        async with RawClient.connect(server.port) as client:
            welcome = await client.hello(good)
            ack = await client.heartbeat()
            assert ack.renewed and ack.token
            renewed = ack.token
            # A resume proof: a wrong one (4509, logged as a close), then the right one.
            proof = p.resume_proof(welcome.session_key, welcome.tid)
            wrong = bytes(b ^ 0xFF for b in proof)
            async with RawClient.connect(server.port) as other:
                await other.send(p.encode(p.Hello(renewed, proof=wrong)))
                assert (await other.expect_close()).code == p.CloseCode.SESSION_IN_USE
            async with RawClient.connect(server.port) as other:
                taken = await other.hello(renewed, proof)
            secrets += [welcome.session_key, taken.session_key, proof, wrong]
        async with RawClient.connect(server.port) as client:
            await client.send(p.encode(p.Hello(forged)))
            refused = await client.expect_close()
            assert (refused.code, refused.reason) == (p.CloseCode.INVALID_TOKEN, "bad_signature")
    finally:
        assert server.stop() == 0
    assert server.process is not None and server.process.stderr is not None
    log = json.dumps(server.log_lines) + server.process.stderr.read().decode()
    # The refusal is logged once, by its reason, and the token is not.
    refusals = [line for line in server.logged("closing") if line["code"] == 4501]
    assert [line["reason"] for line in refusals] == ["bad_signature"], refusals
    for token in (good, forged, renewed):
        signature = token.rsplit(".", 1)[1]
        assert signature not in log
        assert token.split(".")[1] not in log  # nor the claims part
    for secret in secrets:  # nor a key, a proof or what the store keeps of one
        for shown in (secret.hex(), base64.b64encode(secret).decode(), proof_digest(secret)):
            assert shown not in log


async def test_events_group_delivers_each_event_once(home: dict[str, str], redis_server):
    env = {**home, "TOKEND_REDIS_URL": redis_server.url, "TOKEND_KEY_PREFIX": "cligroup"}
    first, second = str(uuid.uuid4()), str(uuid.uuid4())

    client = redis_lib.Redis.from_url(redis_server.url)

    async def acknowledged() -> bool:
        total = 0
        for stream in Keyspace("cligroup").streams():
            with contextlib.suppress(redis_lib.ResponseError):  # no group on it yet
                total += (await asyncio.to_thread(client.xpending, stream, "audit"))["pending"]
        return total == 0

    async def next_event_of_a_fresh_reader() -> dict:
        reader = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tokend",
            "events",
            "--group",
            "audit",
            "--from-start",
            "--consumer",
            "audit-1",
            env={**CLEAN_ENV, **env},
            stdout=asyncio.subprocess.PIPE,
        )
        assert reader.stdout is not None
        try:
            line = await asyncio.wait_for(reader.stdout.readline(), 15)
            # Acknowledged once the reader asks for the next one: wait for XACK.
            await eventually(acknowledged, 15, interval=0.05)
        finally:
            reader.kill()
            await reader.wait()
        return json.loads(line)

    assert (await asyncio.to_thread(tokend, "revoke", first, env=env)).returncode == 0
    assert (await next_event_of_a_fresh_reader())["tid"] == first
    assert (await asyncio.to_thread(tokend, "revoke", second, env=env)).returncode == 0
    # A restarted reader of the same group gets the next event, not the first again.
    assert (await next_event_of_a_fresh_reader())["tid"] == second
    client.close()
