"""Shared plumbing: sizes, servers and client processes we own, statistics, the table.

Every server under test runs as a child process of its own, so that its RSS and CPU
can be read from ``/proc/<pid>``; so does every load generator (:mod:`bench.loadgen`),
so that the client side of 10k loopback connections is spread over several processes
and stays under the per-process open-file limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import io
import json
import math
import os
import pstats
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testkit.certificates import Authority
from testkit.net import LOOPBACK, free_port
from testkit.procs import cpu_split, fd_limit, pin, proc_rss, terminate
from testkit.redis_servers import RedisProcess
from testkit.tokens import minter_in
from testkit.waiting import eventually_sync
from tokend import config
from tokend.core.claims import DEFAULT_PRIO
from tokend.core.protocol import WS_PATH

ROOT = Path(__file__).resolve().parent.parent
# The key prefix of every tokend the harness starts (and so of its streams).
KEY_PREFIX = "bench"
# Descriptors a server keeps besides its connections (listener, Redis pool, logs...).
FD_HEADROOM = 500


class BenchError(RuntimeError):
    """A scenario could not be measured: a process failed (a step that timed out raises
    TimeoutError, which fails the scenario alike)."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big and how long each scenario is; ``--quick`` swaps in :data:`QUICK`."""

    connections: int  # closed-loop connections (heartbeat, Socket.IO round trips)
    warmup: float  # seconds of closed loop before the measured window
    duration: float  # seconds of the measured window
    idle_sessions: tuple[int, ...]  # idle-memory sizes
    storm_sessions: int  # renewal and expiry storms
    renew_rounds: int  # renewal storms, at least a second apart
    expire_after: float  # expiry storm's clock; every session must open before 3/4 of it
    expiry_rate: float  # paced expiry: deadlines a second (0: not run)
    connects: int  # connect storm: sessions opened
    clients: int  # client processes for the scenarios with thousands of connections
    concurrency: int  # handshakes in flight per client process
    drain_connections: int  # drain: sessions on the one worker SIGTERMed


def max_sessions() -> int:
    """As many sessions as the open-file limit lets one server process hold."""
    return max(1000, fd_limit() - FD_HEADROOM)


FULL = Sizes(
    connections=200,
    warmup=2.0,
    duration=10.0,
    idle_sessions=(10_000, max_sessions()),
    storm_sessions=10_000,
    renew_rounds=3,
    expire_after=60.0,
    expiry_rate=20_000,
    connects=10_000,
    clients=4,
    concurrency=50,
    drain_connections=min(19_000, max_sessions()),
)
QUICK = Sizes(
    connections=20,
    warmup=0.5,
    duration=1.5,
    idle_sessions=(200,),
    storm_sessions=200,
    renew_rounds=2,
    expire_after=4.0,
    expiry_rate=2_000,
    connects=300,
    clients=2,
    concurrency=20,
    drain_connections=200,
)


def split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal counts (no zero parts)."""
    parts = max(1, min(parts, total))
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# Statistics


def print_profile(profiler: cProfile.Profile, count: int, what: str, top: int) -> None:
    """A profile's Python calls per ``what`` (``count`` of them), and its ``top`` functions
    by their own time."""
    stats = pstats.Stats(profiler, stream=(text := io.StringIO()))
    calls = sum(entry.callcount for entry in profiler.getstats())
    print(f"{calls / count:.1f} Python calls per {what}")
    stats.sort_stats("tottime").print_stats(top)
    print(text.getvalue())


def callgrind_instructions(module_args: Sequence[str], out: Path) -> int:
    """The instructions ``python -m <module_args>`` runs under callgrind (its file written
    to ``out``), with one hash seed: the same dict and set layouts from run to run."""
    argv = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-m",
        *module_args,
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    # "==pid== Collected : <Ir>" on stderr
    match = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or match is None:
        raise SystemExit(done.stdout + done.stderr)
    return int(match.group(1))


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (0 when empty)."""
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def latency_summary(samples_us: Sequence[int]) -> dict[str, float]:
    """p50/p99/max in milliseconds of latency samples given in microseconds."""
    ordered = sorted(samples_us)
    return {
        "samples": len(ordered),
        "p50_ms": percentile(ordered, 50) / 1000,
        "p99_ms": percentile(ordered, 99) / 1000,
        "max_ms": (ordered[-1] / 1000) if ordered else 0.0,
    }


# Results


@dataclass(slots=True)
class Row:
    """One line of the result table: a tokend figure, its baseline and the target."""

    scenario: str
    metric: str
    value: float | None
    unit: str
    target: str
    met: bool | None
    baseline_name: str = ""
    baseline: float | None = None
    ratio: float | None = None
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def cpu_us_per_op(cpu_pct: float, rate: float) -> float:
    """Microseconds of CPU per operation, from a CPU percentage and an operation rate.

    On a shared machine this is steadier than the rate: a server that loses CPU to a
    neighbour (or waits for a slow client) does fewer operations but not cheaper ones.
    """
    return cpu_pct / 100 / rate * 1e6 if rate else 0.0


def cpu_summary(figures: dict[str, Any], unit: str) -> str:
    """ "CPU <each process>; server <N> us CPU/<unit>"; the server is the first process."""
    cpu = ", ".join(f"{k} {v:.0f}%" for k, v in figures["cpu_pct"].items())
    server_pct = next(iter(figures["cpu_pct"].values()))
    return f"CPU {cpu}; server {cpu_us_per_op(server_pct, figures['rate']):.0f} us CPU/{unit}"


def ratio(value: float, baseline: float) -> float | None:
    return value / baseline if baseline else None


def fmt(value: float | None, unit: str) -> str:
    """A figure with its unit, e.g. ``12,345/s``, ``3.21 ms``, ``1,234 B``."""
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "/s":
        return f"{value:,.0f}/s"
    if unit == "B":
        return f"{value:,.0f} B"
    return f"{value:,.4g} {unit}".strip()


HEADER = ("scenario", "metric", "tokend", "baseline", "ratio", "target", "met")


def table_cells(row: Row) -> tuple[str, ...]:
    baseline = (
        f"{row.baseline_name} {fmt(row.baseline, row.unit)}".strip()
        if row.baseline is not None
        else row.baseline_name or "-"
    )
    met = {True: "yes", False: "NO", None: "-"}[row.met]
    ratio_text = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
    return (
        row.scenario,
        row.metric,
        fmt(row.value, row.unit),
        baseline,
        ratio_text,
        row.target,
        met,
    )


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned plain-text table (also valid Markdown when piped)."""
    cells = [HEADER, *(table_cells(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
        for line in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# Processes


class Child:
    """A server process the harness started and must stop; output goes to a log file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log: Path,
        *,
        port: int,
        env: dict[str, str] | None = None,
        cpus: frozenset[int] | None = None,
        tls: bool = False,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.port = port
        self.env = env
        self.cpus = cpus
        self.tls = tls  # serves wss:// (the bench's certificate: Context.tls_files)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://{LOOPBACK}:{self.port}{WS_PATH}"

    def start(self, ready: str, timeout: float = 30.0, times: int = 1) -> None:
        """Start, pin to ``cpus``, and wait until ``ready`` appears in the log ``times`` times."""
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=ROOT,
            )
        pin(self.pid, self.cpus)
        process = self.process

        def is_ready() -> bool:
            if process.poll() is not None:
                raise BenchError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            return self.log.read_text(errors="replace").count(ready) >= times

        try:
            eventually_sync(is_ready, timeout, what=f"{self.name} logging {ready} x{times}")
        except TimeoutError:
            self.stop()
            raise
        pin(self.pid, self.cpus)  # threads started meanwhile

    def rss(self) -> int:
        return proc_rss(self.pid)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if self.process is not None:
            terminate(self.process, timeout)


@contextlib.contextmanager
def child(
    name: str,
    argv: list[str],
    log: Path,
    *,
    port: int,
    ready: str,
    cpus: frozenset[int] | None,
    env: dict[str, str] | None = None,
    tls: bool = False,
) -> Iterator[Child]:
    proc = Child(name, argv, log, port=port, env=env, cpus=cpus, tls=tls)
    try:
        proc.start(ready)
        yield proc
    finally:
        proc.stop()


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The run's TLS certificate (ECDSA P-256, for 127.0.0.1), its key, and the CA file
    the load generators trust (they verify, as a real client does)."""

    cert: Path
    key: Path
    ca: Path


@dataclass(slots=True)
class TokenPool:
    """Tokens minted for a run, one per line in ``path``; ``tids[i]`` is line i's jti."""

    path: Path
    ttl_s: int
    minted_at: float = field(default_factory=time.time)
    tids: list[uuid.UUID] = field(default_factory=list)


class Context:
    """One harness run: sizes, a scratch directory, signing keys, cached measurements."""

    def __init__(
        self,
        sizes: Sizes,
        workdir: Path,
        log_level: str,
        *,
        pin: bool = True,
        workers: int = 1,
        replica: bool = False,
        settings: dict[str, str] | None = None,
        profile: bool = False,
    ) -> None:
        self.sizes = sizes
        self.workdir = workdir
        self.log_level = log_level
        self.workers = workers
        # Every Redis of the run with a replica in sync (what durable_replicas waits for).
        self.replica = replica
        # tokend settings given on the command line (--set), over each scenario's own.
        self.settings = settings or {}
        # Sample tokend with py-spy where a scenario supports it (bench.resume).
        self.profile = profile
        # The server under test on one CPU, Redis and the load generators on the others.
        self.server_cpus, self.other_cpus = cpu_split() if pin else (None, None)
        self.keys_dir = workdir / "keys"
        self.minter = minter_in(self.keys_dir)
        self._pools: dict[tuple[int, int], TokenPool] = {}
        # Measurements shared by scenarios of the same repetition (e.g. socketio reuses
        # heartbeat's tokend figures); cleared between repetitions.
        self.cache: dict[tuple[Any, ...], Any] = {}
        self._serial = 0
        self._tls: TlsFiles | None = None

    def tls_files(self) -> TlsFiles:
        """A certificate made for this run (once) by a private CA."""
        if self._tls is None:
            directory = self.scratch("tls")
            authority = Authority.create("tokend bench CA")
            cert, key = authority.issue(directory / "cert.pem", directory / "key.pem")
            self._tls = TlsFiles(cert, key, authority.write(directory / "ca.pem"))
        return self._tls

    def scratch(self, name: str) -> Path:
        self._serial += 1
        path = self.workdir / f"{self._serial:03d}-{name}"
        path.mkdir(parents=True)
        return path

    def tokens(self, count: int, ttl_s: int = 3600, prio: int = DEFAULT_PRIO) -> TokenPool:
        """At least ``count`` distinct tokens of this lifetime and ``prio`` (each opens one
        session).

        A pool is reused across scenarios: each scenario has a fresh Redis, so a token
        that opened a session in one scenario starts a new session in the next. A pool
        past half its tokens' lifetime is replaced.
        """
        pool = self._pools.get((ttl_s, prio))
        if pool is None or time.time() - pool.minted_at > ttl_s / 2:
            # New, or half its lifetime gone (a long run, --repeat): mint afresh.
            self._serial += 1
            path = self.workdir / f"tokens-{ttl_s}s-prio{prio}-{self._serial:03d}.txt"
            pool = self._pools[ttl_s, prio] = TokenPool(path, ttl_s)
        missing = count - len(pool.tids)
        if missing > 0:
            with pool.path.open("a") as out:
                for _ in range(missing):
                    tid = uuid.uuid4()
                    sub = f"bench-{tid.hex[:8]}"
                    out.write(self.minter.mint(sub, ttl_s=ttl_s, tid=tid, prio=prio))
                    out.write("\n")
                    pool.tids.append(tid)
        return pool


@contextlib.contextmanager
def redis_server(ctx: Context) -> Iterator[RedisProcess]:
    """A private redis-server (the embedded extra's Valkey) on a loopback port; with
    ``ctx.replica``, a replica of it too, in sync before it is yielded."""
    server = RedisProcess(ctx.scratch("redis"), extra_args=("--repl-diskless-sync-delay", "0"))
    replica = None
    try:
        server.start()
        pin(redis_pid(server), ctx.other_cpus)
        if ctx.replica:
            replica = RedisProcess(
                ctx.scratch("redis-replica"),
                extra_args=("--replicaof", LOOPBACK, str(server.port)),
            )
            replica.start()
            pin(redis_pid(replica), ctx.other_cpus)
            server.wait_replicas(1, timeout=30)
        yield server
    finally:
        if replica is not None:
            replica.stop()
        server.stop()


def redis_pid(server: RedisProcess) -> int:
    assert server.process is not None
    return server.process.pid


@contextlib.contextmanager
def tokend_server(
    ctx: Context, redis_url: str, *, tls: bool = False, **settings: float | int | str
) -> Iterator[Child]:
    """``python -m tokend serve`` (uvloop, JSON logs to a file) as in production; with
    ``tls``, serving wss:// with the run's certificate."""
    if tls:
        files = ctx.tls_files()
        settings = {**settings, "tls_cert_file": str(files.cert), "tls_key_file": str(files.key)}
    server = tokend_child(ctx, redis_url, **settings)
    try:
        # Every worker listening: one alone would take all the first connections.
        server.start('"listening"', times=ctx.workers)
        yield server
    finally:
        server.stop()


def tokend_child(ctx: Context, redis_url: str, **settings: float | int | str) -> Child:
    """The ``python -m tokend serve`` process of :func:`tokend_server`, not started."""
    port = free_port()
    directory = ctx.scratch("tokend")
    env = {
        **os.environ,
        "TOKEND_HOST": LOOPBACK,
        "TOKEND_PORT": str(port),
        "TOKEND_REDIS_URL": redis_url,
        "TOKEND_KEYS_DIR": str(ctx.keys_dir),
        "TOKEND_DATA_DIR": str(directory),
        "TOKEND_KEY_PREFIX": KEY_PREFIX,
        "TOKEND_NODE_NAME": "bench",
        "TOKEND_ADMIN_PORT": "0",  # ephemeral: never collide with another server's
        # Thousands of connections from each loopback address: no per-address cap.
        "TOKEND_MAX_CONNECTIONS_PER_IP": "0",
        "TOKEND_LOG_FORMAT": "json",
        "TOKEND_LOG_LEVEL": ctx.log_level,
        **{config.env_name(k): str(v) for k, v in {**settings, **ctx.settings}.items()},
    }
    env.pop("TOKEND_CONFIG", None)
    argv = [sys.executable, "-m", "tokend", "serve", "--workers", str(ctx.workers)]
    log = directory / "tokend.log"
    # Workers pinned to the one server CPU would only share it: they run unpinned.
    cpus = ctx.server_cpus if ctx.workers == 1 else None
    tls = "tls_cert_file" in settings
    return Child("tokend", argv, log, port=port, env=env, cpus=cpus, tls=tls)


@contextlib.contextmanager
def bare_server(
    ctx: Context, impl: str = "websockets", *, verify: bool = False, tls: bool = False
) -> Iterator[Child]:
    """A server of :mod:`bench.bare_server`: websockets (the baseline), sansio or picows;
    with ``verify``, checking each HELLO's signature with the bench's keys; with ``tls``,
    serving wss:// with the run's certificate and tokend's TLS settings."""
    server = bare_child(ctx, impl, verify=verify, tls=tls)
    try:
        server.start("listening")
        yield server
    finally:
        server.stop()


def bare_child(ctx: Context, impl: str, *, verify: bool = False, tls: bool = False) -> Child:
    """The process of :func:`bare_server`, not started."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.bare_server", "--port", str(port), "--impl", impl]
    if verify:
        argv += ["--verify-keys", str(ctx.keys_dir)]
    if tls:
        files = ctx.tls_files()
        argv += ["--tls-cert", str(files.cert), "--tls-key", str(files.key)]
    name = f"bare-{impl}{'-tls' if tls else ''}"
    log = ctx.scratch(name) / "bare.log"
    return Child(name, argv, log, port=port, cpus=ctx.server_cpus, tls=tls)


# Load generator processes


class ClientPool:
    """Load generator processes (:mod:`bench.loadgen`), each with a slice of connections.

    Every command goes to all processes at once; each answers one JSON line.
    """

    def __init__(
        self,
        ctx: Context,
        name: str,
        *,
        url: str,
        proto: str,
        counts: list[int],
        tokens: TokenPool | None = None,
        first: int = 0,
        sources: Sequence[str] = (),
        event_loop: str = "uvloop",
        opening_at_once: int = 0,
    ) -> None:
        self.ctx = ctx
        # The load generators' event loop and reconnects opening at once (0: unbounded),
        # as bench.loadgen's job takes them.
        self.event_loop = event_loop
        self.opening_at_once = opening_at_once
        self.name = name
        self.url = url
        self.proto = proto
        self.counts = counts
        self.tokens = tokens
        self.first = first
        self.sources = sources  # local addresses, one per process in turn ("" for any)
        self.procs: list[asyncio.subprocess.Process] = []
        self.logs = ctx.scratch(f"clients-{name}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def start(self) -> None:
        offset = self.first
        for i, count in enumerate(self.counts):
            job = {
                "url": self.url,
                "proto": self.proto,
                "tokens": str(self.tokens.path) if self.tokens else "",
                "first": offset,
                "count": count,
                "source": self.sources[i % len(self.sources)] if self.sources else "",
                # wss://: the CA the clients verify the server's certificate with.
                "ca_file": str(self.ctx.tls_files().ca) if self.url.startswith("wss:") else "",
                "event_loop": self.event_loop,
                "opening_at_once": self.opening_at_once,
            }
            offset += count
            with (self.logs / f"client-{i}.log").open("wb") as err:
                self.procs.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        "bench.loadgen",
                        json.dumps(job),
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=err,
                        cwd=ROOT,
                        limit=1 << 26,
                    )
                )
            pin(self.procs[-1].pid, self.ctx.other_cpus)

    async def ask(self, command: str, timeout: float, **args: Any) -> list[dict[str, Any]]:
        """Send one command to every process; their replies, in process order."""
        line = (json.dumps({"cmd": command, **args}) + "\n").encode()
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(line)
            await proc.stdin.drain()
        try:
            async with asyncio.timeout(timeout):
                replies = await asyncio.gather(*(self._reply(p) for p in self.procs))
        except TimeoutError:
            raise BenchError(f"{self.name}: no answer to {command} in {timeout:.0f} s") from None
        for reply in replies:
            if not reply.get("ok"):
                raise BenchError(f"{self.name}: {command} failed: {reply.get('error')}")
        return replies

    async def _reply(self, proc: asyncio.subprocess.Process) -> dict[str, Any]:
        assert proc.stdout is not None
        raw = await proc.stdout.readline()
        if not raw:
            code = await proc.wait()
            return {"ok": False, "error": f"client exited with {code}, see {self.logs}"}
        reply: dict[str, Any] = json.loads(raw)
        return reply

    def kill(self) -> None:
        """SIGKILL every process: its connections vanish as a crashed client's do."""
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()

    async def stop(self) -> None:
        """Drop every connection (no close handshake) and end the processes."""
        for proc in self.procs:
            if proc.returncode is None and proc.stdin is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    proc.stdin.write(b'{"cmd": "exit"}\n')
                    proc.stdin.close()
        for proc in self.procs:
            try:
                async with asyncio.timeout(15):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


@contextlib.asynccontextmanager
async def client_pool(
    ctx: Context,
    name: str,
    *,
    url: str,
    proto: str,
    total: int,
    procs: int,
    tokens: TokenPool | None = None,
    first: int = 0,
    sources: Sequence[str] = (),
    event_loop: str = "uvloop",
    opening_at_once: int = 0,
) -> AsyncIterator[ClientPool]:
    pool = ClientPool(
        ctx,
        name,
        url=url,
        proto=proto,
        counts=split(total, procs),
        tokens=tokens,
        first=first,
        sources=sources,
        event_loop=event_loop,
        opening_at_once=opening_at_once,
    )
    try:
        await pool.start()
        yield pool
    finally:
        await pool.stop()


def storm_pool(
    ctx: Context, server: Child, tokens: TokenPool
) -> contextlib.AbstractAsyncContextManager[ClientPool]:
    """The clients of a storm (renewal, expiry): ``storm_sessions`` tokend sessions over
    ``clients`` processes."""
    return client_pool(
        ctx,
        "tokend",
        url=server.url,
        proto="tokend",
        total=ctx.sizes.storm_sessions,
        procs=ctx.sizes.clients,
        tokens=tokens,
    )


async def open_all(
    pool: ClientPool,
    concurrency: int,
    retry_for: float = 0.0,
    heartbeat: float = 0.0,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Open every connection of the pool; rate, latencies and failures, merged.

    For ``retry_for`` seconds the clients retry what the server asks them to retry. With
    ``heartbeat`` (seconds), each session heartbeats from its WELCOME at that cadence
    until the pool's next command (at most as long as the open may take). A connect
    that failed raises, unless not ``strict`` (then counted in ``errors``).
    """
    timeout = 300 + retry_for
    replies = await pool.ask(
        "connect",
        timeout=timeout,
        concurrency=concurrency,
        retry_for=retry_for,
        heartbeat=heartbeat,
        heartbeat_for=timeout,
    )
    opened = sum(r["opened"] for r in replies)
    failed = sum(r["failed"] for r in replies)
    if failed and strict:
        errors = [r["errors"] for r in replies if r["errors"]]
        raise BenchError(f"{pool.name}: {failed} of {opened + failed} connects failed: {errors}")
    span = max(r["t_end"] for r in replies) - min(r["t_start"] for r in replies)
    return {
        "opened": opened,
        "resumed": sum(r["resumed"] for r in replies),
        "seconds": round(span, 3),
        "rate": opened / span if span > 0 else 0.0,
        "client_cpu_s": round(sum(r["cpu_s"] for r in replies), 2),
        "refusals": dict(sum((Counter(r["refusals"]) for r in replies), Counter())),
        "errors": dict(sum((Counter(r["errors"]) for r in replies), Counter())),
        "heartbeats_sent": sum(r["sent"] for r in replies),
        "lost_after_welcome": dict(sum((Counter(r["closes"]) for r in replies), Counter())),
        **latency_summary([x for r in replies for x in r["latencies_us"]]),
    }
