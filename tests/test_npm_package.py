"""The browser SDK as an npm package (sdk/js/package.json): packed, installed, imported, typed.

``npm pack`` makes the tarball; a scratch project installs it with ``npm install
--offline`` (the package has no dependencies, so no registry is asked), beside ``ws``
(its optional peer dependency, the WebSocket under Node 20) from the npm packages the
browser tests keep (tests/browser/harness.py). Node imports the package by its name, as
sdk/js/README.md shows, and opens a session on a real tokend; ``tsc --strict`` checks a
consumer against the types the package's ``exports`` give. Where Node or npm is missing
the tests skip, and under ``CI=true`` they fail. Node 22's own WebSocket (the bare
import) is tried where the machine's Node is 22 or later; it is optional.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from testkit.events import EventLog
from testkit.net import LOOPBACK
from testkit.tokens import WallClockTokens
from tokend.core import protocol as p
from tokend.ops.app import App

if TYPE_CHECKING:
    from tests.browser.harness import NodeTools

pytest_plugins = ["tests.browser.harness"]

ROOT = Path(__file__).resolve().parent.parent
SDK = ROOT / "sdk" / "js"
CONSUMERS = ROOT / "tests" / "browser"
NAME = "@tokend/client"
NPM_TIMEOUT = 120  # seconds for npm pack or an offline npm install
NODE_TIMEOUT = 30  # seconds for a Node consumer to connect and log out


def run(command: list[str | Path], cwd: Path, timeout: float = NPM_TIMEOUT) -> str:
    """Run ``command``; its stdout, or fail the test with its output."""
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}: {done.stdout}{done.stderr}"
    return done.stdout


@dataclass(frozen=True)
class Packed:
    tarball: Path
    files: list[str]  # paths in the tarball
    manifest: dict[str, Any]  # its package.json


@pytest.fixture(scope="module")
def packed(node_tools: NodeTools, tmp_path_factory: pytest.TempPathFactory) -> Packed:
    """``npm pack`` of sdk/js, the tarball written outside the repository."""
    out = tmp_path_factory.mktemp("pack")
    (report,) = json.loads(run([node_tools.npm, "pack", "--json", "--pack-destination", out], SDK))
    tarball = out / report["filename"]
    assert tarball.is_file()
    manifest = json.loads((SDK / "package.json").read_text())
    return Packed(tarball, sorted(entry["path"] for entry in report["files"]), manifest)


@pytest.fixture(scope="module")
def project(
    packed: Packed, node_tools: NodeTools, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A scratch ES-module project with the tarball installed offline, and ``ws``."""
    directory = tmp_path_factory.mktemp("consumer")
    (directory / "package.json").write_text('{"private": true, "type": "module"}\n')
    ws = node_tools.node_dir / "node_modules" / "ws"
    install: list[str | Path] = [node_tools.npm, "install", "--offline", "--no-audit", "--no-fund"]
    run([*install, packed.tarball, ws], directory)
    for consumer in ("npm_consumer.mjs", "npm_consumer.ts"):
        shutil.copy(CONSUMERS / consumer, directory / consumer)
    return directory


def node_major(node_tools: NodeTools) -> int:
    version = run([node_tools.node, "--version"], ROOT).strip()  # e.g. v20.20.2
    return int(version.lstrip("v").split(".")[0])


async def consume(node_tools: NodeTools, project: Path, mode: str, url: str, token: str) -> Any:
    """tests/browser/npm_consumer.mjs in the scratch project: what its session saw."""
    process = await asyncio.create_subprocess_exec(
        node_tools.node, "npm_consumer.mjs", mode, url, token,
        cwd=project, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), NODE_TIMEOUT)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode()
    return json.loads(out)


def test_the_package_is_named_versioned_and_ships_the_module_and_its_types(packed: Packed):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    manifest = packed.manifest
    assert (manifest["name"], manifest["version"]) == (NAME, pyproject["project"]["version"])
    assert packed.tarball.name == f"tokend-client-{manifest['version']}.tgz"
    assert manifest["type"] == "module"
    assert manifest["exports"]["."] == {"types": "./tokend.d.ts", "default": "./tokend.js"}
    assert manifest["types"] == "./tokend.d.ts"
    assert manifest["engines"] == {"node": ">=20"}
    assert "dependencies" not in manifest
    # ws only where the application brings it (Node 20), never installed on its own.
    assert manifest["peerDependenciesMeta"] == {"ws": {"optional": True}}
    assert packed.files == ["README.md", "package.json", "tokend.d.ts", "tokend.js"]


async def test_under_node_20_with_ws_the_package_imports_by_name_and_gets_a_welcome(
    node_tools: NodeTools, project: Path, app: App, tokens: WallClockTokens, events: EventLog
):
    token = tokens.mint("npm-node20")
    tid = str(tokens.verify(token).tid)
    url = f"ws://{LOOPBACK}:{app.port}{p.WS_PATH}"
    seen = await consume(node_tools, project, "ws", url, token)
    assert seen["tid"] == tid and seen["connected"] and seen["error"] is None, seen
    assert [change["kind"] for change in seen["changes"]] == ["connected", "ended"], seen
    assert seen["changes"][-1]["code"] == 1000
    await events.wait_for("SESSION_STARTED", tid)
    await events.wait_for("SESSION_CLOSED", tid)


async def test_under_node_22_the_package_works_bare_on_nodes_own_websocket(
    node_tools: NodeTools, project: Path, app: App, tokens: WallClockTokens, events: EventLog
):
    major = node_major(node_tools)
    if major < 22:
        pytest.skip(f"Node {major} has no WebSocket of its own (Node 22 and later do)")
    token = tokens.mint("npm-node22")
    tid = str(tokens.verify(token).tid)
    url = f"ws://{LOOPBACK}:{app.port}{p.WS_PATH}"
    seen = await consume(node_tools, project, "bare", url, token)
    assert seen["tid"] == tid and seen["connected"] and seen["error"] is None, seen
    await events.wait_for("SESSION_CLOSED", tid)


@pytest.mark.parametrize(
    "resolution", [("nodenext", "nodenext"), ("esnext", "bundler")], ids=["node", "bundler"]
)
def test_tsc_strict_types_a_consumer_with_the_packages_own_types(
    node_tools: NodeTools, project: Path, resolution: tuple[str, str]
):
    module, resolver = resolution
    tsc: list[str | Path] = [
        node_tools.tsc, "--strict", "--noEmit", "--target", "es2022", "--lib", "es2022,dom",
        "--module", module, "--moduleResolution", resolver,
    ]  # fmt: skip
    run([*tsc, "npm_consumer.ts"], project)
    # The types are the package's, not any: a wrong use of them does not compile.
    (project / "wrong.ts").write_text(
        f"import {{ Session }} from '{NAME}';\n"
        "export const exp = (session: Session): string => session.exp;\n"
    )
    wrong = subprocess.run(
        [*map(str, tsc), "wrong.ts"], cwd=project, capture_output=True, text=True, timeout=60
    )
    assert wrong.returncode != 0 and "error TS2322" in wrong.stdout, wrong.stdout
