"""The keys directory as a node follows it: key files readable by group or
others refused (at start and at a refresh), malformed files logged once and shown in
/readyz while the good keys serve, refreshes off the event loop, and verification at
a time given by the caller."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from testkit.clients import Closed, RawClient
from testkit.net import http_get
from testkit.tokend_process import serve_refused
from testkit.waiting import eventually
from tokend.config import KEYS_REFRESH_INTERVAL, Settings
from tokend.core import protocol as p
from tokend.core.claims import TokenError
from tokend.ops.app import App
from tokend.tokens.keys import KeyFileError, KeyRing
from tokend.tokens.service import TokenService

StartApp = Callable[..., Awaitable[App]]
GARBAGE = b"-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n"
BAD_KID = "20260101T000000Z-0badf11e"


def refusals(captured: str, name: str) -> list[str]:
    """The log lines that refused the key file ``name``."""
    return [line for line in captured.splitlines() if "key file refused" in line and name in line]


def token_of(ring: KeyRing, kid: str, sub: str) -> str:
    """A valid token signed by ``kid`` of ``ring``, whichever key the schedule would pick."""
    now = int(time.time())
    body = {"iss": "tokend", "aud": "tokend", "sub": sub, "jti": str(uuid.uuid4())}
    return ring.sign({**body, "iat": now, "exp": now + 600}, kid)


# --- files readable by group or others ---------------------------------------------------------


def test_a_group_readable_key_refuses_to_start_naming_the_file_and_the_fix(
    keys_dir: Path,
) -> None:
    kid = KeyRing.open(keys_dir).kids[-1]
    pem = keys_dir / f"{kid}.pem"
    pem.chmod(0o640)
    with pytest.raises(KeyFileError) as refused:
        KeyRing.open(keys_dir)
    message = str(refused.value)
    assert str(pem) in message and f"chmod 600 {pem}" in message and "0640" in message
    assert message.startswith("keys_dir: ") and "\n" not in message


def test_tokend_serve_with_a_world_readable_key_exits_2_with_one_line(
    keys_dir: Path, tmp_path: Path
) -> None:
    kid = KeyRing.open(keys_dir).kids[-1]
    pem = keys_dir / f"{kid}.pem"
    pem.chmod(0o644)
    env = {"TOKEND_KEYS_DIR": str(keys_dir), "TOKEND_DATA_DIR": str(tmp_path / "data")}
    done = serve_refused(env, "--port", "0", "--admin-port", "-1")
    assert done.returncode == 2, done.stderr
    # The last line (after the log's "stopped"), and no traceback.
    assert done.stderr.strip().splitlines()[-1] == (
        f"tokend: configuration error: keys_dir: {pem}: readable by group or others "
        f"(mode 0644): run chmod 600 {pem}"
    )
    assert "Traceback" not in done.stderr


def test_a_group_readable_key_is_not_loaded_at_a_refresh_and_logged_once(
    settings: Settings, keys_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ring = KeyRing.open(keys_dir)
    service = TokenService(settings, ring)
    theirs = KeyRing.open(keys_dir)
    new_kid = theirs.rotate()
    new_pem = keys_dir / f"{new_kid}.pem"
    new_pem.chmod(0o604)
    token = token_of(theirs, new_kid, "carol")
    capsys.readouterr()
    for _ in range(3):  # refreshed again and again: one log line for this version
        ring.refresh()
    assert ring.public_key(new_kid) is None
    assert ring.problems == {
        new_pem.name: f"readable by group or others (mode 0604): run chmod 600 {new_pem}"
    }
    assert len(refusals(capsys.readouterr().err, new_pem.name)) == 1
    with pytest.raises(TokenError):
        service.verify(token, time.time())
    # The fix is seen at the next refresh.
    new_pem.chmod(0o600)
    ring.refresh()
    assert service.verify(token, time.time()).sub == "carol"
    assert ring.problems == {}


def test_a_loaded_key_whose_file_turns_group_readable_is_kept(
    settings: Settings, keys_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ring = KeyRing.open(keys_dir)
    kid = ring.kids[-1]
    service = TokenService(settings, ring)
    (keys_dir / f"{kid}.pem").chmod(0o644)
    ring.refresh()
    assert ring.kids == [kid] and f"{kid}.pem" in ring.problems
    assert service.verify(service.mint("dora"), time.time()).sub == "dora"
    assert len(refusals(capsys.readouterr().err, f"{kid}.pem")) == 1


def test_files_tokend_writes_are_0600(keys_dir: Path) -> None:
    ring = KeyRing.open(keys_dir)
    ring.rotate()
    old_umask = os.umask(0)  # even under a permissive umask
    try:
        ring.rotate()
    finally:
        os.umask(old_umask)
    modes = {pem.name: pem.stat().st_mode & 0o777 for pem in keys_dir.glob("*.pem")}
    assert len(modes) == 3 and set(modes.values()) == {0o600}, modes
    assert KeyRing.open(keys_dir).problems == {}


# --- malformed files ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "why"),
    [
        (f"{BAD_KID}.pem", GARBAGE, "not a PEM private key without a passphrase"),
        (f"{BAD_KID}.pem", b"", "not a PEM private key without a passphrase"),
        ("backup.pem", GARBAGE, "not named <YYYYmmddTHHMMSSZ>-<8 hex digits>.pem: ignored"),
    ],
)
def test_a_malformed_file_beside_good_keys_is_refused_once_and_the_others_serve(
    settings: Settings,
    keys_dir: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    content: bytes,
    why: str,
) -> None:
    good = KeyRing.open(keys_dir).kids
    path = keys_dir / name
    path.write_bytes(content)
    path.chmod(0o600)
    capsys.readouterr()
    ring = KeyRing.open(keys_dir)
    ring.refresh()
    assert ring.kids == good and ring.problems == {name: why}
    service = TokenService(settings, ring)
    assert service.verify(service.mint("erin"), time.time()).sub == "erin"
    assert len(refusals(capsys.readouterr().err, name)) == 1


def test_a_directory_with_no_usable_key_refuses_to_start(keys_dir: Path) -> None:
    keys_dir.mkdir(mode=0o700)
    (keys_dir / f"{BAD_KID}.pem").write_bytes(GARBAGE)
    (keys_dir / f"{BAD_KID}.pem").chmod(0o600)
    with pytest.raises(KeyFileError, match=f"no usable signing key in {keys_dir}"):
        KeyRing.open(keys_dir)


def test_a_refresh_never_leaves_the_ring_without_a_key(keys_dir: Path) -> None:
    ring = KeyRing.open(keys_dir)
    kid = ring.kids[-1]
    (keys_dir / f"{kid}.pem").unlink()
    ring.refresh()
    assert ring.kids == [kid]


# --- a running node ----------------------------------------------------------------------------


async def test_a_malformed_pem_added_to_a_running_node_is_logged_once_and_shown_in_readyz(
    start_app: StartApp,
    keys_dir: Path,
    tokens: TokenService,
    capsys: pytest.CaptureFixture[str],
) -> None:
    app = await start_app()
    theirs = KeyRing.open(keys_dir)  # opened before the bad file: logs nothing of it
    bad = keys_dir / f"{BAD_KID}.pem"
    bad.write_bytes(GARBAGE)
    bad.chmod(0o600)
    why = "not a PEM private key without a passphrase"

    async def shown() -> bool:
        status, body = await http_get(app.port, "/readyz")
        return status == 200 and body == {"status": "ready", "keys": {bad.name: why}}

    await eventually(shown, timeout=10 * KEYS_REFRESH_INTERVAL, what="/readyz naming the file")
    assert app.admin is not None
    assert await http_get(app.admin.port, "/readyz") == (
        200,
        {"status": "ready", "keys": {bad.name: why}},
    )
    async with RawClient.connect(app.port) as client:  # HELLOs go on with the good key
        await client.hello(tokens.mint("frank"))
    # A key rotated in afterwards is loaded: refreshes went on, without a second line.
    new_kid = await asyncio.to_thread(theirs.rotate)
    await eventually(
        lambda: new_kid in app.node.tokens.keys.kids, timeout=10 * KEYS_REFRESH_INTERVAL
    )
    assert len(refusals(capsys.readouterr().err, bad.name)) == 1


# Audit events (PEP 578) of the keys directory: (event, thread) while a test watches.
_WATCH: dict[str, Any] = {"dir": None, "seen": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    directory = _WATCH["dir"]
    if directory is None or event not in ("open", "os.scandir", "os.listdir"):
        return
    if args and str(args[0]).startswith(directory):
        _WATCH["seen"].append((event, threading.current_thread() is threading.main_thread()))


sys.addaudithook(_audit)


async def test_a_key_added_is_used_after_a_refresh_and_no_hello_reads_the_disk(
    start_app: StartApp, keys_dir: Path, tokens: TokenService
) -> None:
    app = await start_app()
    theirs = KeyRing.open(keys_dir)
    new_kid = await asyncio.to_thread(theirs.rotate)
    token = token_of(theirs, new_kid, "grace")
    _WATCH.update(dir=str(keys_dir), seen=[])
    try:

        async def welcomed() -> bool:
            async with RawClient.connect(app.port) as client:
                try:
                    await client.hello(token)
                except Closed as closed:
                    assert (closed.code, closed.reason) == (
                        p.CloseCode.INVALID_TOKEN,
                        "unknown_kid",
                    )
                    return False
                return True

        await eventually(welcomed, timeout=10 * KEYS_REFRESH_INTERVAL, interval=0.1)
        # More HELLOs with the old key and the new: none reads the directory.
        for n in range(5):
            async with RawClient.connect(app.port) as client:
                await client.hello(tokens.mint(f"old-{n}"))
        seen = list(_WATCH["seen"])
    finally:
        _WATCH.update(dir=None, seen=[])
    assert ("os.scandir", False) in seen  # the node's refresh read it, in a thread
    assert not [event for event, on_loop in seen if on_loop], seen


# --- verification at a given time --------------------------------------------------------------


T0 = 1_767_225_600  # 2026-01-01T00:00:00Z


def test_verify_judges_times_at_the_now_it_is_given(settings: Settings, keys_dir: Path) -> None:
    service = TokenService(settings, KeyRing.open(keys_dir))
    token = service.mint("heidi", iat=T0, ttl_s=60)
    leeway = settings.leeway
    assert service.verify(token, T0 + 30).exp == T0 + 60
    assert service.verify(token, T0 + 60 + leeway - 0.5).sub == "heidi"  # within leeway
    with pytest.raises(TokenError) as expired:
        service.verify(token, T0 + 60 + leeway)
    assert expired.value.reason == "expired"
    with pytest.raises(TokenError) as early:
        service.verify(token, T0 - leeway - 1)
    assert early.value.reason == "not_yet_valid"


def test_sign_picks_the_key_due_at_the_tokens_iat(settings: Settings, keys_dir: Path) -> None:
    ring = KeyRing.open(keys_dir)
    first = ring.kids[-1]
    second = ring.rotate()
    service = TokenService(settings, ring)
    due = service.schedule.signs_from(second)
    for iat, kid in ((int(due) - 1, first), (int(due) + 1, second)):
        token = service.sign(service.new_claims("ivan", iat=iat))
        assert token.split(".")[0] == ring.sign({}, kid).split(".")[0]  # the header names kid
        assert service.verify(token, iat).iat == iat
