"""The test kit's own checks: the shared wait (testkit.waiting) must fail, or every test
built on it passes whatever happens; the load tests' CPU-wait meter (testkit.procs) must
tell waiting from sleeping; the test Redis servers (testkit.redis_servers) must start on
fresh ports when theirs were taken, and not outlive a start that failed."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.net import LOOPBACK
from testkit.procs import WaitMeter
from testkit.redis_servers import RedisClusterProcess, RedisProcess
from testkit.waiting import eventually, eventually_sync


async def test_eventually_returns_the_first_truthy_result_of_a_function_or_coroutine() -> None:
    calls = itertools.count(1)
    assert await eventually(lambda: next(calls) >= 3 and "done") == "done"

    async def third() -> int:
        return max(0, next(calls) - 5)

    assert await eventually(third) == 1


async def test_eventually_raises_naming_what_it_waited_for_and_the_last_result() -> None:
    with pytest.raises(TimeoutError, match=r"within 0.1 s: the answer \(last: 0\)"):
        await eventually(lambda: 0, 0.1, what="the answer")


async def test_an_exception_from_the_check_ends_the_wait_at_once() -> None:
    def exited() -> bool:
        raise RuntimeError("the process exited")

    with pytest.raises(RuntimeError, match="exited"):
        await eventually(exited, 60)


def test_eventually_sync_has_the_same_contract() -> None:
    calls = itertools.count(1)
    assert eventually_sync(lambda: next(calls) >= 2) is True
    with pytest.raises(TimeoutError, match=r"within 0.05 s: nothing \(last: None\)"):
        eventually_sync(lambda: None, 0.05, what="nothing")


BURN = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass"


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="no /proc/<pid>/schedstat")
def test_wait_meter_tells_a_process_that_waited_for_its_cpu_from_one_that_slept() -> None:
    # Three processes burning one CPU each run a third of the time and wait two thirds (a
    # meter reading CPU time instead would say a third); a sleeping one never waits.
    sleeper = subprocess.Popen(["sleep", "3"])
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(3)]
    try:
        cpu = {min(os.sched_getaffinity(0))}
        for burner in burners:
            os.sched_setaffinity(burner.pid, cpu)
        meter = WaitMeter([sleeper.pid, *(b.pid for b in burners)])
        time.sleep(1.0)  # the window measured
        shares = [meter.share(b.pid) for b in burners]
        assert all(45 < share <= 100 for share in shares), shares
        assert meter.share(sleeper.pid) < 5
        sleeper.kill()
        sleeper.wait()
        assert set(meter.shares({"sleeper": sleeper.pid, "burner": burners[0].pid})) == {"burner"}
    finally:
        for process in (sleeper, *burners):
            process.kill()
            process.wait()


def test_a_redis_whose_ports_were_taken_meanwhile_starts_on_fresh_ones(tmp_path: Path):
    """A port free when picked may be another process's by the time the server binds it
    (an outgoing connection's ephemeral port): the server starts again on fresh ports
    instead of failing the test that needed it (a cluster node: its bus port too)."""
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))  # bound, not listening: as a connection's own port is
        port = taken.getsockname()[1]
        node = RedisProcess(tmp_path, cluster_bus=True, extra_args=("--cluster-enabled", "yes"))
        node.port = node.bus_port = port
        node.start()
        try:
            assert port not in (node.port, node.bus_port) and node.bus_port != node.port
            assert node.client().ping()
            assert "Address already in use" in (tmp_path / "redis.log").read_text()
        finally:
            node.stop()


def test_a_cluster_that_fails_to_start_leaves_no_node_running(tmp_path: Path):
    """Its fixture fails at its start and has no teardown: the nodes already started
    must not outlive the test run (a clean-clone run left two behind)."""
    cluster = RedisClusterProcess(tmp_path)
    broken = cluster.nodes[-1]
    broken.extra_args = (*broken.extra_args, "--no-such-option", "x")
    with pytest.raises(RuntimeError):
        cluster.start()
    started = cluster.nodes[:-1]
    assert all(node.process is not None for node in started)
    assert all(node.process.poll() is not None for node in started if node.process)
