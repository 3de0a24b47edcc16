"""Headless Chromium for the browser tests: installed on first use, driven from Python.

A pytest plugin (``pytest_plugins = ["tests.browser.harness"]`` in a test module):

- :func:`browser_tools` installs what the tests need once per machine: Debian's
  ``chromium`` (with ``apt-get``, as root) and pinned ``playwright-core``,
  ``typescript`` and ``ws`` from npm into a cache directory outside the repository.
  What cannot be installed skips the test with a message saying what failed, and
  fails it under ``CI=true`` (:func:`unavailable`). The installs run when collection
  finishes, outside any test's timeout.
- ``node_dir``: the npm packages alone, for the SDK under Node (no Chromium); missing,
  they skip the test, and fail it under ``CI=true``.
- ``node_tools``: Node, npm and the npm packages, for the npm package's tests: what is
  missing skips the test, and fails it under ``CI=true`` (:func:`unavailable`).
- ``site``: the browser SDK and the test pages over loopback HTTP.
- ``chromium``: one headless Chromium for the test session (``tests/browser/driver.mjs``,
  serving pages on a Unix socket); ``browser``: a page of it in a fresh browser
  context, for one test, as a :class:`BrowserPage`: evaluate JavaScript in the page,
  await what the page reports, take screenshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import json
import os
import select
import shutil
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from testkit.debian import Unavailable, install, run_install
from testkit.net import LOOPBACK

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CHROMIUM = Path("/usr/bin/chromium")
# Pinned npm packages: playwright-core drives Chromium (driver.mjs); typescript
# checks the SDK's declarations (typecheck.ts); ws is the WebSocket of the SDK under
# Node 20 (node_session.mjs).
NODE_PACKAGES = {"playwright-core": "1.65.1", "typescript": "5.9.3", "ws": "8.23.1"}
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokend-tests"
CHROMIUM_START_TIMEOUT = 30  # seconds, for Chromium or a page to be ready
MAX_LINE = 16 * 1024 * 1024  # bytes of one line from the driver (an evaluated value)
# URL prefix -> directory served by the ``site`` fixture.
SITE_ROUTES = {
    "/sdk/": ROOT / "sdk" / "js",
    "/test/": HERE,
}


# Chromium or an npm package is missing and could not be installed (testkit/debian.py).
BrowserUnavailable = Unavailable
_run = run_install


def install_chromium() -> Path:
    """Debian's chromium at /usr/bin/chromium, installed with apt-get if missing."""
    if CHROMIUM.exists():
        return CHROMIUM
    install("chromium", "chromium")
    if not CHROMIUM.exists():
        raise BrowserUnavailable(f"apt-get installed chromium but {CHROMIUM} is missing")
    return CHROMIUM


def install_node_packages() -> Path:
    """A directory whose node_modules holds :data:`NODE_PACKAGES` at their pinned versions."""
    specs = [f"{name}@{version}" for name, version in NODE_PACKAGES.items()]
    target = CACHE / ("node-" + "-".join(specs).replace("/", "_"))
    if all((target / "node_modules" / name / "package.json").exists() for name in NODE_PACKAGES):
        return target
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise BrowserUnavailable(f"node and npm are needed to install {', '.join(specs)}")
    CACHE.mkdir(parents=True, exist_ok=True)
    # Install beside the target and rename, so a broken install is never taken as done.
    staging = Path(tempfile.mkdtemp(prefix="node-", dir=CACHE))
    try:
        (staging / "package.json").write_text('{"private": true}\n')
        _run(
            [npm, "install", "--no-audit", "--no-fund", *specs],
            f"npm install {' '.join(specs)}",
            cwd=staging,
        )
        with contextlib.suppress(OSError):  # another run may have won the race
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass(frozen=True, slots=True)
class BrowserTools:
    chromium: Path
    node_dir: Path  # holds node_modules with NODE_PACKAGES

    @property
    def tsc(self) -> Path:
        return self.node_dir / "node_modules" / ".bin" / "tsc"


@dataclass(frozen=True, slots=True)
class NodeTools:
    node: Path
    npm: Path
    node_dir: Path  # holds node_modules with NODE_PACKAGES

    @property
    def tsc(self) -> Path:
        return self.node_dir / "node_modules" / ".bin" / "tsc"


def unavailable(reason: str) -> NoReturn:
    """Skip the test for want of a part; under ``CI=true`` fail it (README, "Quick
    start": the CI must not pass by skipping)."""
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@functools.cache
def _node_packages() -> Path | str:
    try:
        return install_node_packages()
    except BrowserUnavailable as exc:
        return str(exc)


@functools.cache
def _tools() -> BrowserTools | str:
    node_dir = _node_packages()
    if isinstance(node_dir, str):
        return node_dir
    try:
        return BrowserTools(install_chromium(), node_dir)
    except BrowserUnavailable as exc:
        return str(exc)


def browser_tools() -> BrowserTools:
    """The installed tools, or skip the test saying what could not be installed (fail
    it under ``CI=true``)."""
    tools = _tools()
    if isinstance(tools, str):
        unavailable(f"browser tests need Chromium, playwright-core and typescript: {tools}")
    return tools


class _SiteHandler(http.server.SimpleHTTPRequestHandler):
    """Static files of :data:`SITE_ROUTES`; ES modules need a JavaScript type."""

    extensions_map = {  # noqa: RUF012 - the base class declares it a class attribute
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".js": "text/javascript",
        ".html": "text/html; charset=utf-8",
    }

    def translate_path(self, path: str) -> str:
        clean = path.split("?", 1)[0].split("#", 1)[0]
        for prefix, directory in SITE_ROUTES.items():
            if clean.startswith(prefix):
                self.directory = str(directory)
                return super().translate_path("/" + clean[len(prefix) :])
        return str(ROOT / "nonexistent")

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: pytest shows the page's own reports when a test fails."""


class StaticSite:
    """The :data:`SITE_ROUTES` over HTTP on a loopback port, in a thread."""

    def __init__(self) -> None:
        self.server = http.server.ThreadingHTTPServer((LOOPBACK, 0), _SiteHandler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def origin(self) -> str:
        return f"http://{LOOPBACK}:{self.server.server_address[1]}"

    def __enter__(self) -> StaticSite:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class ChromiumServer:
    """``driver.mjs``: one Chromium for the test session, serving pages on a Unix socket."""

    def __init__(self, tools: BrowserTools, directory: Path) -> None:
        self.socket = directory / "driver.sock"
        self.process = subprocess.Popen(
            [shutil.which("node") or "node", str(HERE / "driver.mjs")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={
                **os.environ,
                "NODE_DIR": str(tools.node_dir),
                "CHROMIUM": str(tools.chromium),
                "SOCKET": str(self.socket),
            },
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], CHROMIUM_START_TIMEOUT)
        if not (ready and self.process.stdout.readline()):
            self.stop()
            raise RuntimeError(f"Chromium did not start within {CHROMIUM_START_TIMEOUT} s")

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class PageError(Exception):
    """An evaluation failed in the page, or the driver went away."""


class BrowserPage:
    """One page of a headless Chromium run by ``driver.mjs``; see its header for the wire."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reports: list[Any] = []
        self.log: list[str] = []  # console lines and page errors, for failure messages
        self.ready = False  # the page is open and can be driven
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0
        self._changed = asyncio.Condition()
        self._reading = asyncio.create_task(self._read())

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, chromium: ChromiumServer) -> AsyncIterator[BrowserPage]:
        page = cls(*await asyncio.open_unix_connection(chromium.socket, limit=MAX_LINE))
        try:
            await page.wait_for(lambda: page.ready, CHROMIUM_START_TIMEOUT, "a browser page")
            yield page
        finally:
            await page._stop()

    async def _read(self) -> None:
        async for line in self.reader:
            message = json.loads(line)
            async with self._changed:
                if "id" in message:
                    reply = self._replies.pop(message["id"])
                    if reply.done():  # its caller gave up waiting (cancelled)
                        pass
                    elif "error" in message:
                        reply.set_exception(PageError(message["error"]))
                    else:
                        reply.set_result(message["value"])
                elif "report" in message:
                    self.reports.append(message["report"])
                elif "ready" in message:
                    self.ready = True
                else:
                    self.log.append(message.get("console") or f"uncaught: {message['pageerror']}")
                self._changed.notify_all()
        for reply in self._replies.values():
            reply.set_exception(PageError(f"the page's connection closed: {self.log[-5:]}"))
        async with self._changed:
            self._changed.notify_all()

    async def _command(self, timeout: float, **command: Any) -> Any:
        if self._reading.done():
            raise PageError(f"the page's connection closed: {self.log[-5:]}")
        self._next_id += 1
        reply = asyncio.get_running_loop().create_future()
        self._replies[self._next_id] = reply
        self.writer.write(json.dumps({"id": self._next_id, **command}).encode() + b"\n")
        await self.writer.drain()
        async with asyncio.timeout(timeout):
            return await reply

    async def goto(self, url: str, timeout: float = 10) -> None:
        await self._command(timeout, op="goto", url=url)

    async def eval(self, expression: str, timeout: float = 10) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        return await self._command(timeout, op="eval", expression=expression)

    async def until(self, condition: str, timeout: float = 10) -> Any:
        """Wait in the page until the JavaScript expression ``condition`` is truthy; its value."""
        return await self.eval(
            f"""new Promise((ok) => {{
              const timer = setInterval(() => {{
                const value = {condition};
                if (value) ok(value, clearInterval(timer));
              }}, 10);
            }})""",
            timeout,
        )

    async def screenshot(self, path: Path, timeout: float = 10) -> Path:
        await self._command(timeout, op="screenshot", path=str(path))
        return path

    async def wait_for(
        self, predicate: Callable[[], Any], timeout: float = 5, what: str = "the page"
    ) -> Any:
        """Wait until ``predicate()`` is truthy (checked whenever the page says something)."""
        try:
            async with asyncio.timeout(timeout), self._changed:
                while not (value := predicate()):
                    if self._reading.done():
                        raise PageError(f"the page's connection closed: {self.log[-5:]}")
                    await self._changed.wait()
                return value
        except TimeoutError:
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what}; "
                f"reports {self.reports[-8:]}; log {self.log[-8:]}"
            ) from None

    async def _stop(self) -> None:
        """Close the connection: the driver closes the page's context, then the socket."""
        if self.writer.can_write_eof():
            self.writer.write_eof()
        try:
            async with asyncio.timeout(10):
                await self._reading
        finally:
            self.writer.close()
            with contextlib.suppress(ConnectionError):
                await self.writer.wait_closed()


@pytest.fixture(scope="session")
def site() -> Iterator[StaticSite]:
    with StaticSite() as running:
        yield running


def pytest_collection_finish(session: pytest.Session) -> None:
    """Install before the first browser test starts: the installs may take longer than
    a test's timeout, and a failure then skips the tests rather than failing one."""
    needs = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    if "tools" in needs:
        _tools()
    elif needs & {"node_dir", "node_tools"}:
        _node_packages()


@pytest.fixture(scope="session")
def tools() -> BrowserTools:
    """Chromium and the npm packages, installed if need be (else the test is skipped, or
    fails under ``CI=true``)."""
    return browser_tools()


@pytest.fixture(scope="session")
def node_dir() -> Path:
    """A directory whose node_modules holds the npm packages (no Chromium needed)."""
    found = _node_packages()
    if isinstance(found, str):
        unavailable(f"Node tests need node and npm packages: {found}")
    return found


@pytest.fixture(scope="session")
def node_tools() -> NodeTools:
    """Node, npm, and a directory whose node_modules holds the npm packages (installed if
    need be); what cannot be had skips the test, or fails it under ``CI=true``."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        unavailable("needs node and npm on PATH")
    found = _node_packages()
    if isinstance(found, str):
        unavailable(f"needs the npm packages {', '.join(NODE_PACKAGES)}: {found}")
    return NodeTools(Path(node), Path(npm), found)


@pytest.fixture(scope="session")
def chromium(
    tools: BrowserTools, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChromiumServer]:
    server = ChromiumServer(tools, tmp_path_factory.mktemp("chromium"))
    yield server
    server.stop()


@pytest.fixture
async def browser(chromium: ChromiumServer) -> AsyncIterator[BrowserPage]:
    async with BrowserPage.open(chromium) as page:
        yield page
    # An uncaught exception in the page is a bug even when the test's checks passed.
    errors = [line for line in page.log if line.startswith("uncaught: ")]
    assert not errors, f"the page logged errors: {errors}"
