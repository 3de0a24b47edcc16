"""The `tokend` command as a newcomer runs it: real processes, embedded Redis."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

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


# --- commands that say what went wrong ---------------------------------------------------


@pytest.mark.parametrize(
    "command", [("revoke", str(uuid.uuid4())), ("sessions", "list"), ("events",)]
)
def test_without_the_servers_redis_a_command_names_the_data_dir_it_tried(
    home: dict[str, str], tmp_path: Path, command: tuple[str, ...]
):
    failed = tokend(*command, env=home, timeout=60)
    data_dir = tmp_path / "home/.local/share/tokend"
    assert failed.returncode == 1
    assert failed.stderr.count("\n") == 1, failed.stderr  # one line, no traceback
    assert failed.stderr.startswith(f"tokend {command[0]}: cannot reach the embedded Redis")
    assert f"of data directory {data_dir} (" in failed.stderr
    assert "TOKEND_DATA_DIR" in failed.stderr


@pytest.mark.parametrize("command", [("sessions", "list"), ("events",)])
def test_without_the_configured_redis_a_command_names_its_url_without_the_password(
    command: tuple[str, ...],
):
    with socket.socket() as closed:  # a port nothing listens on: bound, never listening
        closed.bind(("127.0.0.1", 0))
        url = f"redis://user:secret@127.0.0.1:{closed.getsockname()[1]}/0"
        failed = tokend(*command, "--redis-url", url, "--redis-timeout", "1", env={})
    assert failed.returncode == 1 and failed.stderr.count("\n") == 1, failed.stderr
    shown = url.replace("secret", "***")
    assert failed.stderr.startswith(f"tokend {command[0]}: cannot reach Redis at {shown} (")
    assert "secret" not in failed.stderr


def test_issue_says_when_it_makes_a_new_key_ring(home: dict[str, str], tmp_path: Path):
    first = tokend("issue", "--sub", "alice", env=home)
    keys_dir = tmp_path / "home/.local/share/tokend/keys"
    assert first.returncode == 0 and first.stdout.count(".") == 2  # the token alone
    assert first.stderr.startswith(f"tokend issue: no signing key in {keys_dir}: made a new")
    assert "4501 unknown_kid" in first.stderr and first.stderr.count("\n") == 1
    again = tokend("issue", "--sub", "alice", env=home)
    assert again.returncode == 0 and again.stderr == ""


def test_an_empty_listing_says_so_on_stderr(redis_server: Any):
    env = {"TOKEND_REDIS_URL": redis_server.url, "TOKEND_KEY_PREFIX": f"empty{uuid.uuid4().hex}"}
    listed = tokend("sessions", "list", env=env)
    assert (listed.returncode, listed.stdout) == (0, "")
    assert listed.stderr == "tokend sessions: no live sessions\n"
    warned = tokend("sessions", "list", "--state", "WARN", env=env)
    assert warned.stderr == "tokend sessions: no live sessions in state WARN\n"


LOG_ONE_LINE = (
    "import sys, structlog; from tokend import logs; logs.configure(sys.argv[1]); "
    "structlog.get_logger('tokend.test').info('hello', answer=42)"
)


def logged(log_format: str, terminal: bool) -> str:
    """What one log line looks like on stderr: a terminal's (a pty), or a pipe's."""
    reader, writer = pty.openpty() if terminal else os.pipe()
    with subprocess.Popen(
        [sys.executable, "-c", LOG_ONE_LINE, log_format], stderr=writer, env=CLEAN_ENV
    ) as child:
        os.close(writer)
        assert child.wait(timeout=30) == 0
    with contextlib.suppress(OSError):  # a pty's reader ends with EIO once drained
        return os.read(reader, 4096).decode()
    raise AssertionError("nothing logged")


def test_logs_are_for_a_person_on_a_terminal_and_json_elsewhere():
    assert json.loads(logged("", terminal=False))["event"] == "hello"
    console = logged("", terminal=True)
    assert "hello" in console and "answer" in console and not console.startswith("{")
    assert json.loads(logged("json", terminal=True))["answer"] == 42  # the setting wins
    assert not logged("console", terminal=False).startswith("{")
