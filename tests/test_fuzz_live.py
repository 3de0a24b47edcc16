"""Live fuzz: a running tokend under random and mutated traffic.

Hundreds of connections send what a broken or hostile client would: random bytes,
valid HELLO/HEARTBEAT/BYE frames with bits flipped, cut short, extended or retyped,
every length around each frame's exact size and around the 16 KiB message cap, text
messages, messages in fragments, ping floods, a refused subprotocol. Every connection
must end with a close code from the spec's table (docs/protocol.md §7), never 1011, or
with an HTTP status at the handshake; WebSocket-layer violations end with the RFC 6455
code the library sends. Meanwhile a well-behaved client on the same server gets every
heartbeat acknowledged.

The seed is random per run and printed in every failure; ``TOKEND_FUZZ_SEED=<n>``
replays a run.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter
from collections.abc import Awaitable, Callable

from websockets.frames import Frame, Opcode

from testkit.clients import RawClient, WireClient
from tokend.core import protocol as p
from tokend.ops.app import App
from tokend.tokens.service import TokenService

SEED = int(os.environ.get("TOKEND_FUZZ_SEED", random.randrange(2**32)))
CONNECTIONS = 300
IN_FLIGHT = 40
TIME_BOUND = 15.0  # seconds for the whole run
HEALTHY_CADENCE = 0.25  # seconds between the healthy client's heartbeats
MAX_SIZE = 16384  # the spec's default max message size, which the app keeps
PING_FLOOD = 200  # pings in a burst, beyond max_frame_rate's burst of 50

SPEC_CODES = frozenset(int(c) for c in p.CloseCode) - {int(p.CloseCode.INTERNAL_ERROR)}
# Codes the websockets library itself sends for RFC 6455 violations below tokend's
# protocol (docs/security.md): 1002 protocol error (a continuation frame out of place).
WIRE_CODES = frozenset({1002})

Send = Callable[[WireClient], Awaitable[None]]


def binary(data: bytes) -> Frame:
    return Frame(Opcode.BINARY, data)


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One random mutation of a valid frame's bytes."""
    raw = bytearray(data)
    kind = rng.choice(("flip", "truncate", "extend", "retype", "splice"))
    if kind == "flip":
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del raw[rng.randrange(len(raw)) :]
    elif kind == "extend":
        raw += rng.randbytes(rng.randint(1, 32))
    elif kind == "retype":
        raw[0] = rng.choice([b for b in range(256) if b != raw[0]])
    else:
        at = rng.randrange(len(raw))
        raw[at:at] = rng.randbytes(rng.randint(1, 8))
    return bytes(raw)


def around(rng: random.Random, type_byte: int, exact: int) -> list[bytes]:
    """Messages one shorter, exactly as long as, and one longer than a frame type's size."""
    return [
        bytes([type_byte])[:n] + rng.randbytes(max(0, n - 1)) for n in (exact - 1, exact, exact + 1)
    ]


def fragments(rng: random.Random, data: bytes) -> list[Frame]:
    """``data`` as one binary message in 2..6 fragments (legal WebSocket); in one frame
    when it is too short to cut (a mutation may leave 0 or 1 byte)."""
    if len(data) < 2:
        return [Frame(Opcode.BINARY, data)]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 5))))
    parts = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    frames = [Frame(Opcode.BINARY, parts[0], fin=False)]
    frames += [Frame(Opcode.CONT, part, fin=False) for part in parts[1:-1]]
    return [*frames, Frame(Opcode.CONT, parts[-1], fin=True)]


class Case:
    """One connection's traffic, and the close codes it may end with."""

    def __init__(self, name: str, allowed: frozenset[int] = SPEC_CODES) -> None:
        self.name = name
        self.allowed = allowed
        self.frames: list[Frame] = []
        self.after_welcome: Callable[[p.Welcome], list[Frame]] | None = None
        self.subprotocols: list[str] | None = None


def make_case(rng: random.Random, tokens: TokenService, n: int) -> Case:
    """The n-th connection's case, drawn from ``rng``."""
    hello = p.encode(p.Hello(tokens.mint(f"fuzz-{n}")))
    token_length = len(hello) - 4
    pick = rng.randrange(12)
    if pick == 0:
        case = Case("random bytes")
        case.frames = [
            binary(rng.randbytes(rng.choice((0, 1, 2, 49, 50, 51, rng.randint(0, 600)))))
        ]
    elif pick == 1:
        case = Case("mutated HELLO")
        case.frames = [binary(mutate(rng, hello))]
    elif pick == 2:
        case = Case("mutated HEARTBEAT")
        case.frames = [binary(hello)]

        def heartbeat(welcome: p.Welcome) -> list[Frame]:
            valid = p.make_heartbeat(welcome.session_key, welcome.tid, 1, welcome.exp_ms)
            return [binary(mutate(rng, p.encode(valid)))]

        case.after_welcome = heartbeat
    elif pick == 3:
        case = Case("mutated BYE")
        case.frames = [binary(hello)]
        case.after_welcome = lambda _: [binary(mutate(rng, p.encode(p.Bye())))]
    elif pick == 4:
        case = Case("length around HELLO's")
        case.frames = [binary(rng.choice(around(rng, p.FrameType.HELLO, 4 + token_length)))]
    elif pick == 5:
        case = Case("length around HEARTBEAT's / BYE's, after WELCOME")
        case.frames = [binary(hello)]
        case.after_welcome = lambda _: [
            binary(
                rng.choice(
                    around(rng, p.FrameType.HEARTBEAT, p.HEARTBEAT_LENGTH)
                    + around(rng, p.FrameType.BYE, 1)
                )
            )
        ]
    elif pick == 6:
        size = rng.choice((MAX_SIZE - 1, MAX_SIZE, MAX_SIZE + 1))
        allowed = {int(p.CloseCode.MESSAGE_TOO_BIG)} if size > MAX_SIZE else SPEC_CODES
        case = Case(f"{size}-byte message", frozenset(allowed))
        case.frames = [binary(bytes([rng.randrange(256)]) + rng.randbytes(size - 1))]
    elif pick == 7:
        case = Case("text message", frozenset({int(p.CloseCode.PROTOCOL_ERROR)}))
        case.frames = [Frame(Opcode.TEXT, rng.choice((b"hello", b"\x01", b"{}")))]
    elif pick == 8:
        # A valid HELLO in fragments is a valid HELLO: WELCOME, then (silent) expiry.
        case = Case("fragmented HELLO, then silence", frozenset({int(p.CloseCode.SESSION_EXPIRED)}))
        case.frames = fragments(rng, hello)
    elif pick == 9:
        case = Case("fragmented mutated message")
        case.frames = fragments(rng, mutate(rng, hello))
    elif pick == 10:
        case = Case("ping flood", frozenset({int(p.CloseCode.RATE_LIMITED)}))
        case.frames = [binary(hello)]
        case.after_welcome = lambda _: (
            [Frame(Opcode.PING, rng.randbytes(rng.randint(0, 125)))] * PING_FLOOD
        )
    elif rng.random() < 0.5:
        case = Case("continuation without a start", WIRE_CODES)
        case.frames = [Frame(Opcode.CONT, hello, fin=True)]
    else:
        case = Case("only another subprotocol", frozenset())  # HTTP 400 at the handshake
        case.subprotocols = ["chat.v2"]
    return case


async def run_case(port: int, case: Case) -> str:
    """Play the case; the outcome as ``"close <code>"`` or ``"http <status>"``."""
    client = await WireClient.open(port, subprotocols=case.subprotocols)
    try:
        if client.status != 101:
            return f"http {client.status}"
        try:
            await client.send(*case.frames)
            if case.after_welcome is not None:
                welcome = await client.welcome()
                await client.send(*case.after_welcome(welcome))
        except OSError:
            pass  # the server closed first; its close code is what counts
        return f"close {await client.close_code()}"
    finally:
        client.close()


def acceptable(case: Case, outcome: str) -> bool:
    kind, _, value = outcome.partition(" ")
    if kind == "http":
        return case.subprotocols is not None and value == "400"
    return value != "None" and int(value) in case.allowed


async def test_live_fuzz(start_app: Callable[..., Awaitable[App]], tokens: TokenService):
    # No load shedding: on a busy machine it would answer 503 before any case ran.
    app = await start_app(shed_lag=0)
    assert app.settings.max_message_size == MAX_SIZE
    rng = random.Random(SEED)
    cases = [make_case(rng, tokens, n) for n in range(CONNECTIONS)]
    outcomes: list[str | None] = [None] * CONNECTIONS
    acks = 0
    done = asyncio.Event()

    async def healthy() -> None:
        nonlocal acks
        async with RawClient.connect(app.port) as client:
            await client.hello(tokens.mint("healthy"))
            while not done.is_set():
                assert isinstance(await client.heartbeat(), p.HeartbeatAck)
                acks += 1
                await asyncio.sleep(HEALTHY_CADENCE)

    async def lane(start: int) -> None:
        for n in range(start, CONNECTIONS, IN_FLIGHT):
            try:
                outcomes[n] = await run_case(app.port, cases[n])
            except Exception as exc:
                outcomes[n] = f"error {exc!r}"

    watcher = asyncio.create_task(healthy())
    try:
        async with asyncio.timeout(TIME_BOUND):
            await asyncio.gather(*(lane(i) for i in range(IN_FLIGHT)))
    finally:
        done.set()
    await watcher  # raises if the healthy client lost a heartbeat or its connection
    bad = [
        f"#{n} {case.name}: {outcome}"
        for n, (case, outcome) in enumerate(zip(cases, outcomes, strict=True))
        if outcome is None or not acceptable(case, outcome)
    ]
    summary = Counter(f"{case.name}: {o}" for case, o in zip(cases, outcomes, strict=True))
    assert not bad, f"TOKEND_FUZZ_SEED={SEED}: {bad[:10]}\n{summary}"
    assert acks >= 2, f"TOKEND_FUZZ_SEED={SEED}: the healthy client got {acks} ACKs"
