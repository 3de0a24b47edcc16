"""Processes seen from ``/proc``: their RSS, CPU time, time waiting for a CPU and
children, CPU pinning, and stopping one for good."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path


def fd_limit() -> int:
    """The soft open-file limit each process (server or client) has here."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def proc_rss(pid: int) -> int:
    """Resident set size of a live process, in bytes (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ProcessLookupError(f"no VmRSS for pid {pid}")


def machine_cpu() -> float:
    """CPU seconds the whole machine has been busy since boot, every core and process
    (``/proc/stat``: all but idle and iowait)."""
    ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces
    and parentheses): index 0 is the state, 11 and 12 utime and stime, 19 starttime."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def proc_children(pid: int) -> list[int]:
    """The live child processes of a process (empty if it has gone).

    Each thread lists the children it started (tokend starts its embedded Redis from a
    worker thread), so all threads are read.
    """
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread (or the process) may end meanwhile
            children += [int(c) for c in (task / "children").read_text().split()]
    return children


def proc_cpu(pid: int, *, children: bool = True) -> float:
    """User + system CPU seconds a live process (and its live children) have used so far.

    (The children count for ``tokend serve --workers N``, whose workers do the work.)
    """
    after_name = _stat_fields(pid)
    own = (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")
    for child_pid in proc_children(pid) if children else ():
        with contextlib.suppress(OSError):  # it may have exited meanwhile
            own += proc_cpu(child_pid)
    return own


def proc_sched(pid: int) -> tuple[float, float]:
    """Seconds a live process's main thread has spent on a CPU, and runnable but waiting
    for one (``/proc/<pid>/schedstat``, its first two fields: time on a run queue; Linux
    with CONFIG_SCHED_INFO). On a saturated machine the wait is the time it had work to
    do and the scheduler gave its core to another process."""
    on_cpu, waited = Path(f"/proc/{pid}/schedstat").read_text().split()[:2]
    return int(on_cpu) / 1e9, int(waited) / 1e9


def proc_run_delay(pid: int) -> float:
    """Seconds a live process's main thread has spent waiting for a CPU (:func:`proc_sched`)."""
    return proc_sched(pid)[1]


def proc_started(pid: int) -> float:
    """When a live process started: seconds since boot (``/proc/<pid>/stat``, starttime),
    the clock of :func:`since_boot`."""
    return int(_stat_fields(pid)[19]) / os.sysconf("SC_CLK_TCK")


def since_boot() -> float:
    """Seconds since boot (CLOCK_BOOTTIME, the clock of a process's start time)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class WaitMeter:
    """How much of a window processes spent waiting for a CPU, as a percentage: of the
    window, or of their life in it for those that started during it (a reload's new
    workers, a restart's). A process with 90 % had work to do, and no core, nine tenths
    of the time: the machine, not the process, set its pace."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.began = since_boot()
        # By pid: (its start time, its run-queue time at the window's start). The start
        # time tells a process from a later one given the same pid (pid_max may be 32,768).
        self.before: dict[int, tuple[float, float]] = {}
        for pid in pids:
            with contextlib.suppress(OSError):
                self.before[pid] = (proc_started(pid), proc_run_delay(pid))

    def share(self, pid: int) -> float:
        """The percentage for a live process."""
        started = proc_started(pid)
        before = self.before.get(pid)
        # Counted from 0 if it started in the window (or another process had its pid).
        waited_before = before[1] if before and before[0] == started else 0.0
        waited = proc_run_delay(pid) - waited_before
        since = max(self.began, started)
        return round(100 * waited / max(since_boot() - since, 1e-9), 1)

    def shares(self, roles: Mapping[str, int]) -> dict[str, float]:
        """:meth:`share` of each process by role; one that has exited is left out."""
        found = {}
        for role, pid in roles.items():
            with contextlib.suppress(OSError):
                found[role] = self.share(pid)
        return found


def proc_running(pid: int) -> bool:
    """Whether a process's main thread is running or ready to run (state R), rather
    than asleep waiting for something (an event loop in epoll_wait is S)."""
    return _stat_fields(pid)[0] == "R"


def pin(pid: int, cpus: frozenset[int] | None) -> None:
    """Restrict every thread of a process to these CPUs (no-op when ``cpus`` is None)."""
    if cpus is None:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cpus)


def cpu_split() -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """(server CPUs, everything else): the server under test gets a core to itself.

    On one CPU nothing is pinned.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return frozenset(cpus[:1]), frozenset(cpus[1:])


class CpuMeter:
    """CPU use of some processes over a window, as a percentage of one core.

    ``own`` names the processes measured without their children.
    """

    def __init__(self, pids: dict[str, int], own: frozenset[str] = frozenset()) -> None:
        self.pids = pids
        self.own = own
        self._start: tuple[float, dict[str, float]] | None = None

    def _cpu(self, name: str) -> float:
        return proc_cpu(self.pids[name], children=name not in self.own)

    def start(self) -> None:
        self._start = (time.monotonic(), {n: self._cpu(n) for n in self.pids})

    def stop(self) -> dict[str, float]:
        assert self._start is not None
        began, cpu = self._start
        wall = max(time.monotonic() - began, 1e-9)
        return {n: round(100 * (self._cpu(n) - cpu[n]) / wall, 1) for n in self.pids}


def terminate(process: subprocess.Popen[bytes], timeout: float) -> bool:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``; True if it ended
    on SIGTERM (or had ended already)."""
    if process.poll() is not None:
        return True
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        return False


@contextlib.asynccontextmanager
async def killed_on_exit(process: asyncio.subprocess.Process) -> AsyncIterator[None]:
    """Kill ``process`` (and reap it) on leaving, if it is still running."""
    try:
        yield
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
