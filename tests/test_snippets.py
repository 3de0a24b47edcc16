"""Every command and code block of the user's pages runs as written: README.md, docs/*.md
and the SDKs' READMEs, each page's blocks in the page's order, against the real server
the page itself starts.

A page runs in a copy of the checkout (README.md in a copy without a virtual
environment, as a clean clone is; the other pages in one where ``tokend`` is installed,
as after the README's quick start), with a home directory of its own and no
``TOKEND_*`` variable but those the page exports. Each block runs in a fresh shell
(``bash -e``), in its own process group, with the variables that the page's earlier
blocks exported; what a block leaves running (``tokend serve &``) runs on until the
page ends, then is stopped.

How a block is taken, by its fence's info string:

- ``sh``, ``bash``, ``shell``: run; ``python``: run by the ``python`` on the page's
  PATH; any block with ``file=NAME`` in its info string (```` ```js file=app.mjs ````):
  written to NAME in the page's directory (``~/NAME``: in its home), for a later block
  to run.
- Any other block (output, a unit file, JSON) must be marked before its fence, or the
  test fails: ``<!-- snippet: skip, why -->``.

Other marks, on the line before the fence (several joined with ``;``):
``<!-- snippet: wait for URL -->`` (after the block, wait until URL answers 200, as a
reader waits for the ``listening`` line), ``<!-- snippet: keeps running; wait for URL
-->`` (a server in the foreground, left running once URL answers),
``<!-- snippet: interrupt after N -->`` (a Ctrl-C after N seconds), ``<!-- snippet: exit
N -->`` (the status the block ends with; 0 unless marked). The ports the pages name
(8765, 8766, ...) must be free when a page starts.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from testkit.tokend_process import CLEAN_ENV

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
    "sdk/python/README.md",
    "sdk/js/README.md",
]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>```+)(?P<info>[^`\n]*)$")
MARK = re.compile(r"^\s*<!--\s*snippet:\s*(?P<marks>.*?)\s*-->\s*$")
SHELLS = {"sh", "bash", "shell"}
BLOCK_TIMEOUT = 600  # seconds: the README's install of the server is the longest
# The ports the pages name: a page cannot run where another process holds one.
PAGE_PORTS = (8765, 8766, 8775, 8776, 8785, 8786, 8795, 8796)


@dataclass
class Block:
    page: str
    line: int  # of the opening fence
    info: str
    text: str
    marks: dict[str, str] = field(default_factory=dict)

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def file(self) -> str | None:
        found = re.search(r"\bfile=(\S+)", self.info)
        return found.group(1) if found else None

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.info or 'no language'})"


def blocks_of(page: str) -> list[Block]:
    """The fenced blocks of a page, each with the marks on the line before it."""
    lines = (ROOT / page).read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, ticks = opening.group("indent"), opening.group("ticks")
        end = index + 1
        while not lines[end].strip().startswith(ticks):
            end += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end]) + "\n"
        before = next((line for line in reversed(lines[:index]) if line.strip()), "")
        marks: dict[str, str] = {}
        if mark := MARK.match(before):
            for part in mark.group("marks").split(";"):
                name, _, value = part.strip().partition(" ")
                marks[name.rstrip(",")] = value.strip(" ,")
        blocks.append(Block(page, index + 1, opening.group("info").strip(), body, marks))
        index = end + 1
    return blocks


def unmarked(block: Block) -> bool:
    """A block that neither runs, nor is written to a file, nor is marked to skip."""
    runs = block.language in SHELLS or block.language == "python"
    return not (runs or block.file or "skip" in block.marks)


def test_every_block_of_every_page_runs_or_says_why_not() -> None:
    silent = [str(b) for page in PAGES for b in blocks_of(page) if unmarked(b)]
    assert silent == [], "mark each with <!-- snippet: skip, why --> or give it file="
    assert any(b.marks for page in PAGES for b in blocks_of(page))


def copy_checkout(into: Path) -> Path:
    """The checkout's files as git sees them (tracked, and new ones not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            target = into / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return into


@pytest.fixture(scope="module")
def installed_checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout with ``tokend`` installed in its ``.venv``, as a reader has
    it after the README's quick start (and the test extras, which the docs' load tests
    and benchmarks use)."""
    checkout = copy_checkout(tmp_path_factory.mktemp("installed") / "tokend")
    subprocess.run([sys.executable, "-m", "venv", ".venv"], cwd=checkout, check=True)
    subprocess.run(
        [".venv/bin/pip", "install", "-q", "-e", ".[test]"],
        cwd=checkout,
        check=True,
        capture_output=True,
        timeout=BLOCK_TIMEOUT,
    )
    return checkout


def port_taken(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def wait_for(url: str, timeout: float = 60, process: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``url`` answers 200; a ``process`` that ends meanwhile fails the wait."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer 200 within {timeout} s")
        time.sleep(0.2)


class Page:
    """One page's run: its directory, its home, its exports, what its blocks left running."""

    def __init__(self, page: str, checkout: Path, home: Path) -> None:
        self.page = page
        self.checkout = checkout
        self.home = home
        venv_bin = checkout / ".venv" / "bin"
        self.env = {
            **CLEAN_ENV,
            "HOME": str(home),
            "PATH": f"{venv_bin}:{CLEAN_ENV['PATH']}" if venv_bin.is_dir() else CLEAN_ENV["PATH"],
            # An installed tokend, not the one this test runs from.
            "PYTHONPATH": "",
            "VIRTUAL_ENV": str(checkout / ".venv") if venv_bin.is_dir() else "",
            "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_RUNTIME_DIR": str(home / "run"),
        }
        self.groups: list[int] = []
        self.ran = 0

    def run(self, block: Block, scratch: Path) -> None:
        if block.file:  # relative to the page's directory, or to its home (~/)
            home = block.file.startswith("~/")
            target = self.home / block.file[2:] if home else self.checkout / block.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text)
            return
        if "skip" in block.marks:
            return
        names: list[str] = []  # the variables the block exports
        env_out = scratch / f"block-{block.line}.env"
        if block.language == "python":
            script = scratch / f"block-{block.line}.py"
            script.write_text(block.text)
            command = ["python", str(script)]
        else:
            script = scratch / f"block-{block.line}.sh"
            for line in block.text.replace("\\\n", " ").splitlines():
                if exported := re.search(r"(?:^|[;&]\s*)export\s+(.*)", line):
                    names += re.findall(r"(?:^|\s)(\w+)=", exported.group(1))
            dump = f'\nenv -0 > "{env_out}"\n' if names else "\n"
            script.write_text(block.text + dump)
            command = ["bash", "-e", "-o", "pipefail", str(script)]
        out = scratch / f"block-{block.line}.out"
        with out.open("w") as output:
            process = subprocess.Popen(
                command,
                cwd=self.checkout,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.groups.append(process.pid)
        interrupt = block.marks.get("interrupt")
        if "keeps" in block.marks:  # a server in the foreground of its own terminal
            url = block.marks["wait"].removeprefix("for").strip()
            try:
                wait_for(url, BLOCK_TIMEOUT, process)
            except AssertionError as exc:
                raise AssertionError(f"{block}: {exc}:\n{out.read_text()}") from None
            self.ran += 1
            return
        try:
            if interrupt is not None:
                seconds = float(interrupt.removeprefix("after").strip())
                try:
                    process.wait(timeout=seconds)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGINT)
            status = process.wait(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"{block}: still running after {BLOCK_TIMEOUT} s") from None
        expected = int(block.marks.get("exit", "0"))
        assert status == expected, f"{block} exited {status}:\n{block.text}\n{out.read_text()}"
        if block.language != "python" and names:
            values = dict(
                item.split("=", 1) for item in (env_out.read_text().split("\0")) if "=" in item
            )
            self.env.update({name: values[name] for name in names if name in values})
        if then := block.marks.get("wait"):
            wait_for(then.removeprefix("for").strip())
        self.ran += 1

    def stop(self) -> None:
        """Everything the page's blocks left running: SIGTERM, then SIGKILL."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = []
            for group in self.groups:
                try:
                    os.killpg(group, sig)
                    alive.append(group)
                except ProcessLookupError:
                    pass
            if not alive:
                return
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and any(_group_alive(g) for g in alive):
                time.sleep(0.1)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def page_checkout(page: str, tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    if page == "README.md":  # from a clean clone: its quick start makes the venv
        return copy_checkout(tmp_path / "tokend")
    return request.getfixturevalue("installed_checkout")


@pytest.fixture
def free_page_ports() -> Iterator[None]:
    taken = [port for port in PAGE_PORTS if port_taken(port)]
    if taken:
        message = f"ports the pages name are taken by another process: {taken}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    yield


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs_as_written(
    page: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    free_page_ports: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    blocks = blocks_of(page)
    checkout = page_checkout(page, tmp_path, request)
    (tmp_path / "home" / "run").mkdir(parents=True)
    scratch = tmp_path / "blocks"
    scratch.mkdir()
    run = Page(page, checkout, tmp_path / "home")
    try:
        for block in blocks:
            run.run(block, scratch)
    finally:
        run.stop()
    skipped = sum("skip" in b.marks for b in blocks)
    written = sum(bool(b.file) for b in blocks)
    with capsys.disabled():
        print(f"\n{page}: ran {run.ran} blocks, wrote {written} files, skipped {skipped} marked")
    assert run.ran + written + skipped == len(blocks)
