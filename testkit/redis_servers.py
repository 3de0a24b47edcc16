"""Private redis-servers on loopback ports (never the machine's shared one): one alone,
a cluster of three masters, a sentinel. The binary is ``redis-server`` on PATH or the
embedded extra's Valkey (:func:`tokend.ops.embedded.find_server_binary`)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.cluster import key_slot
from redis.retry import Retry

from testkit import replies
from testkit.net import LOOPBACK, free_port
from testkit.waiting import eventually_sync
from tokend.ops.embedded import find_server_binary


def _until_answering(
    process: subprocess.Popen[bytes], log: Path, probe: Callable[[], object], timeout: float
) -> None:
    """Until ``probe()`` (a command to the new server) answers truthy; the server's log
    as the error if it exits first."""

    def answers() -> bool:
        if process.poll() is not None:
            # A server refused its command line before it opened its log.
            said = log.read_text() if log.exists() else "(no log)"
            raise RuntimeError(f"exited with {process.returncode}: {said}")
        with contextlib.suppress(redis.RedisError):
            return bool(probe())
        return False

    eventually_sync(answers, timeout, what=f"{log.stem} answering")


# The probe of a starting server: each answer at once, a server that exited seen at once
# (redis-py retries a refused connect with a backoff of seconds by default).
NO_RETRY = Retry(NoBackoff(), 0)
# Starts of a server whose port another process took between free_port() and its bind
# (an outgoing connection's ephemeral port may be any free one): each with fresh ports.
BIND_ATTEMPTS = 3


class RedisProcess:
    """A private redis-server on a loopback port, never the machine's shared one; with
    ``cluster_bus``, a cluster node with its bus on a port of its own too."""

    def __init__(
        self,
        directory: Path,
        *,
        aof: bool = False,
        extra_args: Sequence[str] = (),
        cluster_bus: bool = False,
    ) -> None:
        self.directory = directory
        self.port = free_port()
        # An explicit bus port: the default (port + 10000) may be taken or too high.
        self.bus_port = free_port() if cluster_bus else None
        self.aof = aof
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self) -> None:
        """Start it and wait until it answers; a server that does not is stopped, not
        left running past the test."""
        for attempt in range(1, BIND_ATTEMPTS + 1):
            try:
                self._start()
                return
            except BaseException as exc:
                self.stop()
                taken = isinstance(exc, RuntimeError) and "Address already in use" in str(exc)
                if not taken or attempt == BIND_ATTEMPTS:
                    raise
            self.port = free_port()
            if self.bus_port is not None:
                self.bus_port = free_port()

    def _start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        bus = () if self.bus_port is None else ("--cluster-port", str(self.bus_port))
        self.process = subprocess.Popen(
            [
                find_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                LOOPBACK,
                "--dir",
                str(self.directory),
                "--save",
                "",
                "--appendonly",
                "yes" if self.aof else "no",
                "--appendfsync",
                "always",
                "--logfile",
                str(self.directory / "redis.log"),
                *bus,
                *self.extra_args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=0.5, retry=NO_RETRY)
        _until_answering(self.process, self.directory / "redis.log", client.ping, 10)

    def wait_replicas(self, count: int = 1, timeout: float = 10) -> None:
        """Until ``count`` replicas are connected and online (in sync) with this master."""
        client = self.client()

        def in_sync() -> bool:
            info = client.info("replication")
            online = [info[f"slave{n}"] for n in range(info["connected_slaves"])]
            return len([r for r in online if r["state"] == "online"]) == count

        eventually_sync(in_sync, timeout, what=f"{count} replica(s) in sync")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def client(self) -> redis.Redis:
        return redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=2, decode_responses=True)


class RedisClusterProcess:
    """Three cluster-enabled masters on loopback ports, no replicas, all slots assigned."""

    SLOTS = 16384

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.directory = directory
        self.nodes = [self._node(f"node-{n}") for n in range(masters)]
        self.replicas: list[RedisProcess] = []

    def _node(self, name: str) -> RedisProcess:
        return RedisProcess(
            self.directory / name,
            cluster_bus=True,
            extra_args=(
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "5000",
                # A new replica's first sync starts at once, not 5 s later.
                "--repl-diskless-sync-delay",
                "0",
            ),
        )

    def master_of(self, key: str) -> int:
        """Which node (index) serves ``key``'s slot, as :meth:`start` assigned them."""
        share = self.SLOTS // len(self.nodes)
        return min(key_slot(key.encode()) // share, len(self.nodes) - 1)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{LOOPBACK}:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 20) -> None:
        """Start the nodes and join them; on a failure the nodes started are stopped (a
        fixture that fails at its start has no teardown to do it)."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        for node in self.nodes:
            node.start()
        clients = [redis.Redis(host=LOOPBACK, port=n.port, socket_timeout=2) for n in self.nodes]
        share = self.SLOTS // len(self.nodes)  # the split master_of() assumes
        for n, client in enumerate(clients):
            last = self.SLOTS - 1 if n == len(clients) - 1 else (n + 1) * share - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", n * share, last)
            client.execute_command(
                "CLUSTER", "MEET", LOOPBACK, self.nodes[0].port, self.nodes[0].bus_port
            )
        eventually_sync(
            lambda: all(c.cluster("INFO")["cluster_state"] == "ok" for c in clients),
            timeout,
            interval=0.05,
            what="redis cluster at cluster_state:ok",
        )
        decoding = [node.client() for node in self.nodes]
        eventually_sync(
            lambda: self._bus_ready(decoding),
            timeout,
            interval=0.05,
            what="redis cluster bus links between every two nodes known at both ends",
        )

    @staticmethod
    def _bus_ready(clients: list[redis.Redis]) -> bool:
        """Whether every node has a bus link to every other that the other end has taken
        for that node's own (it has had a full message, a PING, on it).

        PUBLISH travels over these links. Valkey 8.1 sends it as a light message, which
        the receiving node refuses, closing the link and dropping the message, on a link
        it has not yet taken for the sender's (fixed in valkey-io/valkey#2817): in a
        cluster's first seconds, after cluster_state:ok, what a test published was lost.
        """
        # links[n][(direction, node id)] = when the link was made (ms), as node n sees it
        links: list[dict[tuple[str, str], int]] = []
        ids = []
        for client in clients:
            ids.append(client.execute_command("CLUSTER", "MYID"))
            links.append(
                {
                    (link["direction"], link["node"]): link["create-time"]
                    for link in client.execute_command("CLUSTER", "LINKS")
                }
            )
        for a, a_id in enumerate(ids):
            for b, b_id in enumerate(ids):
                if a == b:
                    continue
                made = links[a].get(("to", b_id))
                taken = links[b].get(("from", a_id))
                if made is None or taken is None or taken < made:
                    return False
        return True

    def add_replica(self, master: int, timeout: float = 20) -> RedisProcess:
        """A new node replicating ``self.nodes[master]``, returned once it is in sync and
        every master lists it as that master's replica."""
        replica = self._node(f"replica-{len(self.replicas)}")
        self.replicas.append(replica)
        replica.start()
        client = redis.Redis(host=LOOPBACK, port=replica.port, socket_timeout=2)
        masters = [redis.Redis(host=LOOPBACK, port=n.port, socket_timeout=2) for n in self.nodes]
        master_id = masters[master].execute_command("CLUSTER", "MYID").decode()
        client.execute_command(
            "CLUSTER", "MEET", LOOPBACK, self.nodes[0].port, self.nodes[0].bus_port
        )

        def replicating() -> bool:
            with contextlib.suppress(redis.ResponseError):  # the master is not known yet
                client.execute_command("CLUSTER", "REPLICATE", master_id)
                return True
            return False

        # Each master's node table names it as this master's replica (gossip takes a moment).
        row = b" slave " + master_id.encode() + b" "

        def listed() -> bool:
            synced = client.info("replication").get("master_link_status") == "up"
            return synced and all(row in m.execute_command("CLUSTER", "NODES") for m in masters)

        eventually_sync(replicating, timeout, interval=0.05, what="CLUSTER REPLICATE accepted")
        eventually_sync(listed, timeout, interval=0.05, what="cluster replica in sync")
        return replica

    def stop(self) -> None:
        for node in self.nodes + self.replicas:
            node.stop()


class RedisSentinelProcess:
    """A redis-server in sentinel mode watching ``master`` as service ``service``."""

    def __init__(
        self,
        directory: Path,
        master: RedisProcess,
        service: str = "tokend",
        *,
        quorum: int = 1,
        options: dict[str, int] | None = None,
    ) -> None:
        self.directory = directory
        self.master = master
        self.service = service
        self.quorum = quorum
        # Per-service settings: down-after-milliseconds, failover-timeout...
        self.options = options or {}
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://{LOOPBACK}:{self.port}/{self.service}/0"

    def start(self, timeout: float = 10) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        conf = self.directory / "sentinel.conf"  # sentinel rewrites its config file
        conf.write_text(
            f"port {self.port}\nbind {LOOPBACK}\ndir {self.directory}\n"
            f"logfile {self.directory / 'sentinel.log'}\n"
            f"sentinel monitor {self.service} {LOOPBACK} {self.master.port} {self.quorum}\n"
            + "".join(f"sentinel {k} {self.service} {v}\n" for k, v in self.options.items())
        )
        self.process = subprocess.Popen(
            [find_server_binary(), str(conf), "--sentinel"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=0.5, retry=NO_RETRY)
        _until_answering(
            self.process,
            self.directory / "sentinel.log",
            lambda: client.sentinel_get_master_addr_by_name(self.service),
            timeout,
        )

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=2, decode_responses=True)


def wait_sentinels_settled(
    sentinels: Sequence[RedisSentinelProcess], replicas: int, timeout: float
) -> None:
    """Wait until every sentinel knows the master's ``replicas`` and every other sentinel
    (a failover asked before then may find no quorum or no replica to promote)."""
    clients = [s.client() for s in sentinels]
    eventually_sync(
        lambda: all(
            len(replies.rows(c.sentinel_slaves(s.service))) == replicas
            and len(replies.rows(c.sentinel_sentinels(s.service))) == len(sentinels) - 1
            for s, c in zip(sentinels, clients, strict=True)
        ),
        timeout,
        what="sentinels know the replica and each other",
    )
