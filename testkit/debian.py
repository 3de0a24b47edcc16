"""A program a test needs from a Debian package, installed with apt-get when missing.

Where it cannot be had (not root, no apt-get, no network) the test is skipped with
the reason, except under ``CI=true``, where a missing part fails the test
(README, "Quick start": the CI must not pass by skipping).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

INSTALL_TIMEOUT = 900  # seconds; a one-time install (apt, npm)


class Unavailable(Exception):
    """A program is missing and could not be installed; the message says why."""


def run_install(command: list[str], what: str, **kwargs: Any) -> None:
    """Run an installing command; :class:`Unavailable` with its last lines if it fails."""
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT,
            check=False,
            stdin=subprocess.DEVNULL,
            **kwargs,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{what}: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise Unavailable(f"{what} exited {done.returncode}: {' | '.join(tail)}")


def _apt_get(*args: str) -> None:
    # Wait for another apt/dpkg run rather than failing on its lock.
    command = ["apt-get", "-o", "DPkg::Lock::Timeout=300", *args]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run_install(command, " ".join(["apt-get", *args]), env=env)


@functools.cache
def install(package: str, program: str) -> Path:
    """The path of ``program``, from Debian's ``package``, installed first if missing."""
    found = shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin")
    if found:
        return Path(found)
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"{program} is missing and we cannot apt-get {package} (not root)")
    try:
        _apt_get("install", "-y", "--no-install-recommends", package)
    except Unavailable:
        _apt_get("update")  # perhaps stale package lists: refresh once and retry
        _apt_get("install", "-y", "--no-install-recommends", package)
    found = shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin")
    if not found:
        raise Unavailable(f"apt-get installed {package} but {program} is not there")
    return Path(found)


def require(package: str, program: str) -> Path:
    """:func:`install`, or skip the test with the reason (fail it under ``CI=true``)."""
    try:
        return install(package, program)
    except Unavailable as exc:
        reason = f"needs {program} (Debian package {package}): {exc}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
