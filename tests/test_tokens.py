"""Unit tests of signing keys, minting and verification (tokend/tokens/service.py). No network."""

from __future__ import annotations

import base64
import contextlib
import copy
import hashlib
import hmac
import json
import math
import multiprocessing
import pickle
import stat
import time
import uuid
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from tokend import config
from tokend.config import Settings
from tokend.core.claims import Claims, TokenError
from tokend.tokens import service as tokens_module
from tokend.tokens.keys import KID_PATTERN, KeyRing
from tokend.tokens.schedule import KeySchedule
from tokend.tokens.service import TokenService

# --- helpers ----------------------------------------------------------------------------------


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def b64url_json(value: Any) -> str:
    return b64url(json.dumps(value, separators=(",", ":")).encode())


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    values = {"keys_dir": str(tmp_path / "keys"), "data_dir": str(tmp_path), **overrides}
    return config.load(values, environ={})


def claims(**changes: Any) -> dict[str, Any]:
    """Valid claims for the default settings; a value of None drops the claim."""
    now = int(time.time())
    body: dict[str, Any] = {
        "iss": "tokend",
        "aud": "tokend",
        "sub": "alice",
        "jti": str(uuid.uuid4()),
        "iat": now,
        "exp": now + 900,
    }
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


def private_key(ring: KeyRing, kid: str) -> Ed25519PrivateKey:
    """The private key of ``kid``, read from its file as any holder of the directory can."""
    key = serialization.load_pem_private_key((ring.directory / f"{kid}.pem").read_bytes(), None)
    assert isinstance(key, Ed25519PrivateKey)
    return key


def write_key_file(path: Path, key: Ed25519PrivateKey) -> None:
    """A key file as an operator puts one in the keys directory: PKCS8 PEM, mode 0600."""
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    path.chmod(0o600)


def sign(ring: KeyRing, body: dict[str, Any], **headers: Any) -> str:
    """Sign arbitrary claims/headers with the ring's newest private key."""
    kid = ring.kids[-1]
    key = private_key(ring, kid)
    return jwt.encode(body, key, algorithm="EdDSA", headers={"kid": kid, **headers})


def raw_token(header: dict[str, Any], body: dict[str, Any], signature: bytes = b"") -> str:
    return f"{b64url_json(header)}.{b64url_json(body)}.{b64url(signature)}"


def sign_raw(ring: KeyRing, header: dict[str, Any], body: dict[str, Any]) -> str:
    """A token with a genuine signature by the newest key over any header (PyJWT-free)."""
    signing_input = f"{b64url_json(header)}.{b64url_json(body)}"
    signature = private_key(ring, ring.kids[-1]).sign(signing_input.encode())
    return f"{signing_input}.{b64url(signature)}"


def kids_on_disk(directory: Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.pem"))


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path)


@pytest.fixture
def ring(settings: Settings) -> KeyRing:
    return KeyRing.open(settings.resolved_keys_dir)


@pytest.fixture
def service(settings: Settings, ring: KeyRing) -> TokenService:
    return TokenService(settings, ring)


def refused(service: TokenService, token: str, reason: str) -> None:
    """``token`` is refused as invalid (4501) for ``reason`` (docs/protocol.md §7)."""
    with pytest.raises(TokenError) as info:
        service.verify(token, time.time())
    assert info.value.expired is False
    assert info.value.reason == reason


# --- minting ----------------------------------------------------------------------------------


def test_mint_verify_round_trip(service: TokenService) -> None:
    tid = uuid.uuid4()
    iat = int(time.time())
    token = service.mint("alice", ttl_s=600, prio=7, tid=tid, iat=iat)
    assert service.verify(token, time.time()) == Claims(
        tid=tid, sub="alice", iat=iat, exp=iat + 600, prio=7
    )


def test_mint_defaults(service: TokenService, ring: KeyRing) -> None:
    before = int(time.time())
    token = service.mint("bob")
    after = int(time.time())
    got = service.verify(token, time.time())
    assert got.sub == "bob"
    assert got.prio == 5
    assert before <= got.iat <= after
    assert got.exp == got.iat + 900
    assert got.tid.version == 4
    header = jwt.get_unverified_header(token)
    assert header["alg"] == "EdDSA"
    assert header["kid"] == ring.kids[-1]
    payload = jwt.decode(token, options={"verify_signature": False})
    assert set(payload) == {"iss", "aud", "sub", "jti", "iat", "exp"}  # prio 5 is implied
    assert payload["iss"] == payload["aud"] == "tokend"
    assert payload["jti"] == str(got.tid)


@pytest.mark.parametrize(
    ("prio", "sub"), [(5, "alice"), (0, "alice"), (9, "alice"), (5, 'a"b\\c/\u00e9\u2028\x01')]
)
def test_tokens_are_the_bytes_pyjwt_makes(
    service: TokenService, ring: KeyRing, prio: int, sub: str
) -> None:
    """TokenService.sign writes the claims' JSON and KeyRing the JWS itself (for speed):
    the same bytes as jwt.encode, a sub that JSON escapes included."""
    token = service.mint(sub, prio=prio)
    body = jwt.decode(token, options={"verify_signature": False})
    assert token == sign(ring, body)
    public = ring.public_key(ring.kids[-1])
    assert public is not None
    assert jwt.decode(token, public, algorithms=["EdDSA"], audience="tokend")["sub"] == sub


@pytest.mark.parametrize("prio", [5, 0])
def test_a_renewed_token_is_the_bytes_pyjwt_makes_of_its_new_times(
    service: TokenService, ring: KeyRing, prio: int
) -> None:
    """sign_as (a renewal) writes the claims with the iat and exp it is given, the rest
    the claims': the bytes jwt.encode makes of them, verified by PyJWT."""
    first = service.new_claims("alice", prio=prio)
    iat, exp = first.iat - 60, first.iat - 60 + 3600
    token = service.sign_as(first, iat, exp)
    assert isinstance(token, bytes)
    body = jwt.decode(token, options={"verify_signature": False})
    assert (body["iat"], body["exp"], body["jti"]) == (iat, exp, str(first.tid))
    assert token.decode() == sign(ring, body)
    public = ring.public_key(ring.kids[-1])
    assert public is not None
    assert jwt.decode(token, public, algorithms=["EdDSA"], audience="tokend")["sub"] == "alice"


def test_the_signing_kid_kept_for_a_time_follows_the_ring(
    settings: Settings, ring: KeyRing, service: TokenService
) -> None:
    """signing_kid keeps its last answer for the same time and ring only: a key added
    meanwhile (another list of kids) is asked of the schedule again."""
    old_kid = ring.kids[-1]
    new_kid = ring.rotate()
    due = service.schedule.signs_from(new_kid)
    assert service.signing_kid(due - 1) == old_kid
    assert service.signing_kid(due) == new_kid
    assert service.signing_kid(due) == new_kid  # kept
    (settings.resolved_keys_dir / f"{new_kid}.pem").unlink()
    ring.refresh()  # the new key's file gone: the ring has the old key alone
    assert ring.kids == [old_kid]
    assert service.signing_kid(due) == old_kid


def test_minted_tokens_have_fresh_ids(service: TokenService) -> None:
    assert (
        service.verify(service.mint("a"), time.time()).tid
        != service.verify(service.mint("a"), time.time()).tid
    )


@pytest.mark.parametrize("prio", [0, 9])
def test_mint_prio_bounds(service: TokenService, prio: int) -> None:
    token = service.mint("alice", prio=prio)
    assert service.verify(token, time.time()).prio == prio
    assert jwt.decode(token, options={"verify_signature": False})["prio"] == prio


@pytest.mark.parametrize("prio", [-1, 10])
def test_mint_refuses_prio_out_of_range(service: TokenService, prio: int) -> None:
    with pytest.raises(ValueError):
        service.mint("alice", prio=prio)


def test_issuer_and_audience_come_from_settings(tmp_path: Path, ring: KeyRing) -> None:
    other = TokenService(make_settings(tmp_path, issuer="auth", audience="api"), ring)
    token = other.mint("alice")
    payload = jwt.decode(token, options={"verify_signature": False})
    assert (payload["iss"], payload["aud"]) == ("auth", "api")
    assert other.verify(token, time.time()).sub == "alice"
    # The same key, but another issuer and audience: refused by the default service.
    refused(TokenService(make_settings(tmp_path), ring), token, "wrong_issuer")


# --- key ring ---------------------------------------------------------------------------------


def test_open_on_empty_dir_creates_exactly_one_key(settings: Settings) -> None:
    directory = settings.resolved_keys_dir
    assert not directory.exists()
    ring = KeyRing.open(directory)
    assert kids_on_disk(directory) == [ring.kids[-1]]
    assert KID_PATTERN.match(ring.kids[-1])


def test_key_files_are_private(settings: Settings) -> None:
    directory = settings.resolved_keys_dir
    ring = KeyRing.open(directory)
    ring.rotate()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    pems = list(directory.glob("*.pem"))
    assert len(pems) == 2
    for pem in pems:
        assert stat.S_IMODE(pem.stat().st_mode) == 0o600
        key = serialization.load_pem_private_key(pem.read_bytes(), password=None)
        assert isinstance(key, Ed25519PrivateKey)
    # No temporary files left behind.
    assert {p.name for p in directory.iterdir()} == {p.name for p in pems} | {".lock"}


def test_second_open_reuses_the_key(settings: Settings) -> None:
    directory = settings.resolved_keys_dir
    first = KeyRing.open(directory)
    second = KeyRing.open(directory)
    assert second.kids[-1] == first.kids[-1]
    assert kids_on_disk(directory) == [first.kids[-1]]
    token = TokenService(settings, first).mint("alice")
    assert TokenService(settings, second).verify(token, time.time()).sub == "alice"


def test_a_rotated_key_verifies_at_once_and_signs_after_the_publish_delay(
    settings: Settings, ring: KeyRing, service: TokenService
) -> None:
    old_kid = ring.kids[-1]
    new_kid = ring.rotate()
    assert new_kid > old_kid
    assert kids_on_disk(settings.resolved_keys_dir) == ring.kids == [old_kid, new_kid]
    # Published at once: a token of the new key verifies, and the JWKS lists it.
    assert service.verify(sign(ring, claims()), time.time()).sub == "alice"
    assert service.published_kids(time.time()) == [old_kid, new_kid]
    # It signs only after key_publish_delay (900 s by default): the old key goes on.
    token = service.mint("alice")
    assert jwt.get_unverified_header(token)["kid"] == old_kid == service.signing_kid(time.time())
    due = service.schedule.signs_from(new_kid)
    assert time.time() + 899 < due <= time.time() + 901
    assert service.schedule.signing(ring.kids, due - 0.001) == old_kid
    assert service.schedule.signing(ring.kids, due) == new_kid


# Kids of keys made at known times: the schedule decides from the kids alone.
T0 = "20260101T000000Z-00000000"  # made in the second from 1767225600
T1 = "20260101T001000Z-00000000"  # 600 s later
T2 = "20260101T001001Z-00000000"  # 601 s later


def test_key_schedule_signs_with_the_newest_key_due_and_retires_after_its_tokens() -> None:
    start = 1767225600.0
    schedule = KeySchedule(publish_delay=100, retire_after=50)
    kids = [T0, T1, T2]
    assert schedule.signs_from(T0) == start + 1 + 100  # the end of its second, plus the delay
    timeline = {
        start: (T0, [T0, T1, T2]),  # none due yet: the oldest signs
        start + 101: (T0, [T0, T1, T2]),
        start + 600 + 100.999: (T0, [T0, T1, T2]),
        start + 600 + 101: (T1, [T0, T1, T2]),  # T1 due: T0 stops signing
        start + 601 + 101: (T2, [T0, T1, T2]),  # T2 due one second later: T1 never signed long
        start + 600 + 101 + 49.999: (T2, [T0, T1, T2]),
        start + 600 + 101 + 50: (T2, [T1, T2]),  # T0's tokens have all expired
        start + 601 + 101 + 50: (T2, [T2]),
    }
    for now, (signing, published) in timeline.items():
        assert (schedule.signing(kids, now), schedule.published(kids, now)) == (
            signing,
            published,
        ), now
    assert schedule.retires_at(T2, kids) == math.inf


def test_a_retired_key_neither_verifies_nor_is_published(settings: Settings) -> None:
    """A key superseded longer than token_ttl + leeway ago (900 + 5 s by default)."""
    directory = settings.resolved_keys_dir
    directory.mkdir(parents=True)
    retired, successor = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    write_key_file(directory / f"{T0}.pem", retired)
    write_key_file(directory / f"{T1}.pem", successor)
    service = TokenService(settings, KeyRing.open(directory))
    assert service.published_kids(time.time()) == [T1] == [k["kid"] for k in service.jwks()["keys"]]
    old = jwt.encode(claims(), retired, algorithm="EdDSA", headers={"kid": T0})
    refused(service, old, "unknown_kid")
    new = jwt.encode(claims(), successor, algorithm="EdDSA", headers={"kid": T1})
    assert service.verify(new, time.time()).sub == "alice"


def test_a_key_deleted_from_the_directory_is_dropped(settings: Settings, ring: KeyRing) -> None:
    service = TokenService(settings, ring)
    old_kid, new_kid = ring.kids[-1], ring.rotate()
    token = sign(ring, claims())
    assert service.verify(token, time.time()).sub == "alice"
    (settings.resolved_keys_dir / f"{new_kid}.pem").unlink()
    ring.refresh()  # a node does it every KEYS_REFRESH_INTERVAL
    refused(service, token, "unknown_kid")
    assert [k["kid"] for k in service.jwks()["keys"]] == [old_kid]


def test_rotations_in_quick_succession_each_become_the_newest(ring: KeyRing) -> None:
    # Kids carry a one-second timestamp; rotating twice in a second must still move forward.
    kids = [ring.kids[-1]]
    for _ in range(20):
        kids.append(ring.rotate())
        assert ring.kids[-1] == kids[-1]
    assert kids == sorted(kids)
    assert len(set(kids)) == len(kids)
    assert all(KID_PATTERN.match(kid) for kid in kids)


def test_rotate_goes_after_keys_another_ring_wrote(settings: Settings) -> None:
    a = KeyRing.open(settings.resolved_keys_dir)
    b = KeyRing.open(settings.resolved_keys_dir)
    b_kid = b.rotate()
    a_kid = a.rotate()  # a has not reloaded, yet its new key must sort after b's
    assert a_kid > b_kid
    fresh = KeyRing.open(settings.resolved_keys_dir)
    assert fresh.kids[-1] == a_kid
    assert len(kids_on_disk(settings.resolved_keys_dir)) == 3


def test_jwks_lists_every_key(ring: KeyRing, service: TokenService) -> None:
    old_kid = ring.kids[-1]
    old_token = service.mint("alice")
    new_kid = ring.rotate()
    new_token = sign(ring, claims())
    jwks = service.jwks()
    assert set(jwks) == {"keys"}
    by_kid = {k["kid"]: k for k in jwks["keys"]}
    assert set(by_kid) == {old_kid, new_kid}
    assert len(jwks["keys"]) == 2
    for kid, jwk in by_kid.items():
        assert jwk["kty"] == "OKP"
        assert jwk["crv"] == "Ed25519"
        assert "=" not in jwk["x"]
        raw = unb64url(jwk["x"])
        assert len(raw) == 32
        public = ring.public_key(kid)
        assert public is not None
        assert raw == public.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        assert "d" not in jwk  # never the private part
    # Another service can verify offline with the JWKS alone.
    for token, kid in ((old_token, old_kid), (new_token, new_kid)):
        key = jwt.PyJWK(by_kid[kid]).key
        payload = jwt.decode(token, key, algorithms=["EdDSA"], audience="tokend", issuer="tokend")
        assert payload["sub"] == "alice"


def test_verify_picks_up_a_key_rotated_by_another_ring_at_the_next_refresh(
    settings: Settings,
) -> None:
    mine = KeyRing.open(settings.resolved_keys_dir)
    service = TokenService(settings, mine)
    theirs = KeyRing.open(settings.resolved_keys_dir)
    new_kid = theirs.rotate()
    token = sign(theirs, claims(sub="carol"))
    # Verification reads no file: the new key is unknown until the ring is refreshed.
    refused(service, token, "unknown_kid")
    assert mine.public_key(new_kid) is None
    mine.refresh()
    assert service.verify(token, time.time()).sub == "carol"
    assert mine.public_key(new_kid) is not None


def test_unknown_kid_in_a_fresh_service(settings: Settings, ring: KeyRing) -> None:
    token = sign(ring, claims(), kid="20000101T000000Z-deadbeef")
    refused(TokenService(settings, ring), token, "unknown_kid")


def _open_and_sign(keys_dir: str, barrier: Any, results: Any) -> None:
    """Child process: race the others to open an empty keys dir, then sign a token."""
    barrier.wait(timeout=20)
    ring = KeyRing.open(Path(keys_dir))
    sub = f"p{multiprocessing.current_process().pid}"
    results.put((ring.kids[-1], sign(ring, claims(sub=sub))))


def test_concurrent_open_from_several_processes(settings: Settings) -> None:
    directory = settings.resolved_keys_dir
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_open_and_sign, args=(str(directory), barrier, results))
        for _ in range(4)
    ]
    for proc in procs:
        proc.start()
    try:
        got = [results.get(timeout=30) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
    assert [proc.exitcode for proc in procs] == [0, 0, 0, 0]
    kids = {kid for kid, _ in got}
    assert len(kids) == 1  # exactly one key was generated, and every process uses it
    assert kids_on_disk(directory) == sorted(kids)
    service = TokenService(settings, KeyRing.open(directory))
    assert len({service.verify(token, time.time()).sub for _, token in got}) == 4


# --- refused tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("alg", ["none", "None", "NONE", "nOnE"])
def test_alg_none_is_refused(service: TokenService, ring: KeyRing, alg: str) -> None:
    header = {"alg": alg, "typ": "JWT", "kid": ring.kids[-1]}
    # An unsecured JWS has an empty signature segment: not even a JWS of ours.
    refused(service, raw_token(header, claims()), "malformed")
    refused(service, raw_token({"alg": alg}, claims()), "malformed")
    refused(service, raw_token(header, claims(), b"x" * 64), "bad_algorithm")


def _hs256(header: dict[str, Any], body: dict[str, Any], secret: bytes) -> str:
    signing_input = f"{b64url_json(header)}.{b64url_json(body)}".encode()
    mac = hmac.new(secret, signing_input, hashlib.sha256).digest()
    return f"{signing_input.decode()}.{b64url(mac)}"


def test_hs256_with_the_public_key_as_secret_is_refused(
    service: TokenService, ring: KeyRing
) -> None:
    kid = ring.kids[-1]
    public = ring.public_key(kid)
    assert public is not None
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    pem = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = {"alg": "HS256", "typ": "JWT", "kid": kid}
    for secret in (raw, pem, service.jwks()["keys"][0]["x"].encode()):
        refused(service, _hs256(header, claims(), secret), "bad_algorithm")


@pytest.mark.parametrize("alg", ["RS256", "ES256", "PS256", "HS512", "Ed25519", "eddsa", ""])
def test_algorithms_outside_the_allow_list_are_refused(
    service: TokenService, ring: KeyRing, alg: str
) -> None:
    header = {"alg": alg, "typ": "JWT", "kid": ring.kids[-1]}
    refused(service, raw_token(header, claims(), b"x" * 64), "bad_algorithm")


def test_missing_alg_is_refused(service: TokenService, ring: KeyRing) -> None:
    refused(service, raw_token({"kid": ring.kids[-1]}, claims(), b"x" * 64), "bad_algorithm")


@pytest.mark.parametrize(
    "kid",
    [
        "../../etc/passwd",
        "../" + "20000101T000000Z-deadbeef",
        "20000101T000000Z-deadbeef/../x",
        "20000101T000000Z-deadbeef.pem",
        "/etc/passwd",
        "",
        "x" * 300,
        123,
        None,
        ["a"],
    ],
    ids=repr,
)
def test_malformed_kid_is_refused(service: TokenService, ring: KeyRing, kid: Any) -> None:
    body = claims()
    good = sign_raw(ring, {"alg": "EdDSA", "typ": "JWT", "kid": ring.kids[-1]}, body)
    assert (
        service.verify(good, time.time()).sub == "alice"
    )  # the hand-made token is fine but for its kid
    refused(
        service, sign_raw(ring, {"alg": "EdDSA", "typ": "JWT", "kid": kid}, body), "unknown_kid"
    )


def test_missing_kid_is_refused(service: TokenService, ring: KeyRing) -> None:
    key = private_key(ring, ring.kids[-1])
    token = jwt.encode(claims(), key, algorithm="EdDSA")
    assert "kid" not in jwt.get_unverified_header(token)
    refused(service, token, "unknown_kid")


def test_kid_of_a_valid_key_with_another_keys_signature_is_refused(
    service: TokenService, ring: KeyRing
) -> None:
    stranger = Ed25519PrivateKey.generate()
    token = jwt.encode(claims(), stranger, algorithm="EdDSA", headers={"kid": ring.kids[-1]})
    refused(service, token, "bad_signature")


def test_tampered_payload_or_signature_is_refused(service: TokenService, ring: KeyRing) -> None:
    token = sign(ring, claims(sub="alice"))
    head, body, sig = token.split(".")
    forged_body = b64url_json({**json.loads(unb64url(body)), "sub": "mallory"})
    refused(service, f"{head}.{forged_body}.{sig}", "bad_signature")
    flipped = sig[:10] + ("A" if sig[10] != "A" else "B") + sig[11:]
    refused(service, f"{head}.{body}.{flipped}", "bad_signature")
    refused(service, f"{head}.{body}.", "malformed")


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"iss": "someone-else"}, "wrong_issuer"),
        ({"iss": ""}, "wrong_issuer"),
        ({"aud": "other"}, "wrong_audience"),
        ({"aud": ""}, "wrong_audience"),
        ({"aud": ["tokend"]}, "wrong_audience"),
        ({"aud": ["tokend", "other"]}, "wrong_audience"),
        ({"jti": "not-a-uuid"}, "bad_jti"),
        ({"jti": str(uuid.UUID(int=0x12345678_9ABC_4DEF_8123_456789ABCDEF)).upper()}, "bad_jti"),
        ({"jti": uuid.UUID(int=0x12345678_9ABC_4DEF_8123_456789ABCDEF).hex}, "bad_jti"),
        ({"jti": "{" + str(uuid.UUID(int=1)) + "}"}, "bad_jti"),
        ({"jti": "urn:uuid:" + str(uuid.UUID(int=1))}, "bad_jti"),
        ({"jti": 12345}, "bad_jti"),
        ({"prio": 10}, "bad_prio"),
        ({"prio": -1}, "bad_prio"),
        ({"prio": "5"}, "bad_prio"),
        ({"prio": 5.0}, "bad_prio"),
        ({"prio": 5.5}, "bad_prio"),
        ({"prio": True}, "bad_prio"),
        ({"prio": False}, "bad_prio"),
        ({"prio": [5]}, "bad_prio"),
        ({"sub": ""}, "bad_sub"),
        ({"sub": "x" * 257}, "bad_sub"),
        ({"sub": 42}, "bad_sub"),
        # A year ahead: parameters are made at collection, long before a slow run gets here.
        ({"exp": int(time.time()) + 86400 * 365 + 0.5}, "bad_time"),
        ({"exp": "soon"}, "bad_time"),
        ({"exp": 1 << 42}, "bad_time"),
        ({"iat": "now"}, "bad_time"),
        ({"iat": float(int(time.time()))}, "bad_time"),
    ],
    ids=repr,
)
def test_bad_claims_are_refused(
    service: TokenService, ring: KeyRing, changes: dict[str, Any], reason: str
) -> None:
    refused(service, sign(ring, claims(**changes)), reason)


@pytest.mark.parametrize("name", ["iss", "aud", "sub", "jti", "iat", "exp"])
def test_each_required_claim_missing_is_refused(
    service: TokenService, ring: KeyRing, name: str
) -> None:
    body = claims()
    del body[name]
    refused(service, sign(ring, body), "missing_claim")


@pytest.mark.parametrize("prio", [0, 9])
def test_prio_bounds_are_accepted(service: TokenService, ring: KeyRing, prio: int) -> None:
    assert service.verify(sign(ring, claims(prio=prio)), time.time()).prio == prio


def test_sub_of_256_characters_is_accepted(service: TokenService, ring: KeyRing) -> None:
    assert service.verify(sign(ring, claims(sub="x" * 256)), time.time()).sub == "x" * 256


def test_signed_malformed_payload_is_refused(service: TokenService, ring: KeyRing) -> None:
    kid = ring.kids[-1]
    head = b64url_json({"alg": "EdDSA", "typ": "JWT", "kid": kid})
    for payload in (b"{not json", b"[1, 2]", b'"string"', b"\xff\xfe"):
        signing_input = f"{head}.{b64url(payload)}".encode()
        signature = private_key(ring, kid).sign(signing_input)
        refused(service, f"{signing_input.decode()}.{b64url(signature)}", "malformed")


@pytest.mark.parametrize(
    "token",
    [
        "",
        "garbage",
        "a.b",
        "a.b.c",
        "a.b.c.d",
        "!!!.###.$$$",
        "..",
        b64url(b"not json") + ".e30.",
        b64url(b"[]") + ".e30.",
        b64url_json({"alg": "EdDSA", "kid": "20000101T000000Z-deadbeef"}) + ".%%%.abc",
        "Bearer " + "x" * 40,
    ],
    ids=repr,
)
def test_garbage_is_refused(service: TokenService, token: str) -> None:
    refused(service, token, "malformed")


# --- time claims and leeway -------------------------------------------------------------------


def test_expired_beyond_leeway_is_refused_as_expired(service: TokenService, ring: KeyRing) -> None:
    now = int(time.time())
    with pytest.raises(TokenError) as info:
        service.verify(sign(ring, claims(iat=now - 910, exp=now - 10)), now)
    assert info.value.expired is True


def test_expired_within_leeway_is_accepted(service: TokenService, ring: KeyRing) -> None:
    now = int(time.time())
    token = sign(ring, claims(iat=now - 903, exp=now - 3))
    assert service.verify(token, now).exp == now - 3


def test_zero_leeway_refuses_just_expired(tmp_path: Path, ring: KeyRing) -> None:
    service = TokenService(make_settings(tmp_path, leeway=0), ring)
    now = int(time.time())
    with pytest.raises(TokenError) as info:
        service.verify(sign(ring, claims(iat=now - 903, exp=now - 3)), now)
    assert info.value.expired is True


def test_iat_in_the_future_beyond_leeway_is_refused(service: TokenService, ring: KeyRing) -> None:
    now = int(time.time())
    refused(service, sign(ring, claims(iat=now + 60, exp=now + 960)), "not_yet_valid")


def test_iat_in_the_future_within_leeway_is_accepted(service: TokenService, ring: KeyRing) -> None:
    now = int(time.time())
    assert service.verify(sign(ring, claims(iat=now + 3, exp=now + 903)), now).iat == now + 3


def test_expired_token_with_another_fault_is_not_reported_as_merely_expired(
    service: TokenService, ring: KeyRing
) -> None:
    # A bad signature must never be answered with "expired" (4502): it is invalid (4501).
    now = int(time.time())
    stranger = Ed25519PrivateKey.generate()
    token = jwt.encode(
        claims(iat=now - 910, exp=now - 10),
        stranger,
        algorithm="EdDSA",
        headers={"kid": ring.kids[-1]},
    )
    refused(service, token, "bad_signature")


@hsettings(max_examples=300, deadline=None)
@given(st.text(alphabet="ABCDEFabcdef0123456789-_.=+/ ", max_size=120))
def test_verify_raises_only_token_error_on_any_text(text: str) -> None:
    service = _fuzz_service()
    with contextlib.suppress(TokenError):
        service.verify(text, time.time())


@hsettings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=400), st.binary(min_size=1, max_size=3))
def test_verify_raises_only_token_error_on_mutated_tokens(at: int, junk: bytes) -> None:
    service = _fuzz_service()
    token = service.mint("fuzz")
    at %= len(token)
    mutated = token[:at] + junk.decode("latin-1") + token[at + 1 :]
    try:
        service.verify(mutated, time.time())
    except TokenError:
        pass
    else:
        assert mutated == token or service.verify(mutated, time.time()).sub == "fuzz"


_FUZZ: list[TokenService] = []


def _fuzz_service() -> TokenService:
    if not _FUZZ:
        import tempfile

        directory = Path(tempfile.mkdtemp())
        settings_ = config.load(
            {"keys_dir": str(directory / "k"), "data_dir": str(directory)}, environ={}
        )
        _FUZZ.append(TokenService(settings_, KeyRing.open(settings_.resolved_keys_dir)))
    return _FUZZ[0]


# --- the check without the signature (a resume): the same refusals ----------------------------


@pytest.mark.parametrize("junk", ["=", "+", "/", " ", "\x00", "é", "\u0663", "\ud7ff", ".."])
@pytest.mark.parametrize("segment", [0, 1, 2])
def test_a_character_outside_base64url_is_malformed_with_or_without_the_signature(
    service: TokenService, junk: str, segment: int
) -> None:
    """Each segment is base64url only (RFC 7515 2), whether or not the signature is
    verified: padding, the standard alphabet's + and /, whitespace, non-ASCII letters
    and digits, an empty segment are all malformed."""
    parts = service.mint("alice").split(".")
    parts[segment] = parts[segment][:5] + junk + parts[segment][5:]
    token = ".".join(parts)
    for signature in (True, False):
        with pytest.raises(TokenError) as info:
            service.check(token, time.time(), signature=signature)
        assert info.value.reason == "malformed", (junk, segment, signature)
    parts[segment] = ""
    with pytest.raises(TokenError, match="malformed"):
        service.check(".".join(parts), time.time(), signature=False)


def test_a_checked_tokens_tid_is_its_jti(service: TokenService) -> None:
    """The tid of a checked token is the UUID of its jti, and writes as the jti did
    (tokens.Tid keeps the text); equal and hashed as a plain UUID, copied with it."""
    token = service.mint("alice")
    jti = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "==="))["jti"]
    for signature in (True, False):
        tid = service.check(token, time.time(), signature=signature)[0].tid
        assert isinstance(tid, uuid.UUID) and str(tid) == jti
        assert tid == uuid.UUID(jti) and hash(tid) == hash(uuid.UUID(jti))
        assert str(copy.copy(tid)) == jti and str(pickle.loads(pickle.dumps(tid))) == jti


@hsettings(max_examples=500, deadline=None)
@given(st.text(alphabet="ABCXYZabcxyz0189-_+/=.é ", max_size=40))
def test_a_segment_decodes_as_urlsafe_b64decode_decodes_it(segment: str) -> None:
    """tokens._b64decode reads a segment (padding added) as base64.urlsafe_b64decode does:
    the same bytes, or a ValueError (binascii.Error is one) where it raises."""
    padded = segment + "=" * (-len(segment) % 4)
    try:
        expected: bytes | type[Exception] = base64.urlsafe_b64decode(padded)
    except ValueError as exc:
        expected = type(exc)
    try:
        got: bytes | type[Exception] = tokens_module._b64decode(segment)
    except ValueError as exc:
        got = type(exc)
    if isinstance(expected, bytes):
        assert got == expected
    else:
        assert isinstance(got, type) and issubclass(got, ValueError)
