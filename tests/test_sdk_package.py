"""The Python SDK as a client application gets it: its own wheel (sdk/python), installed in
a fresh virtual environment with nothing of the server, holding a session against
``tokend serve``; and the server's wheel, built from what the Dockerfile copies, carrying
the same SDK."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from testkit.tokend_process import CLEAN_ENV, TokendProcess, tokend

ROOT = Path(__file__).resolve().parent.parent
SDK = ROOT / "sdk" / "python"
# Clocks short enough to see renewals within seconds: a heartbeat every 0.5 s, tokens of
# 3 s renewed in their last 2.
CLOCKS = {
    "TOKEND_HEARTBEAT_INTERVAL": "0.5",
    "TOKEND_WARN_AFTER": "1.5",
    "TOKEND_EXPIRE_AFTER": "2",
    "TOKEND_TOKEN_TTL": "3",
    "TOKEND_RENEW_WINDOW": "2",
}


def build_wheel(source: Path, into: Path) -> Path:
    """``pip wheel`` of a source tree: the wheel file it made."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(into), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = into.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def sdk_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the SDK's wheel installed: its python."""
    where = tmp_path_factory.mktemp("sdk")
    wheel = build_wheel(SDK, where / "dist")
    venv.create(where / "venv", with_pip=True)
    python = where / "venv" / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return python


def installed(python: Path) -> dict[str, list[str]]:
    """Each distribution of the environment, with what it requires (run from /, so that
    nothing of the checkout is on its path)."""
    script = (
        "import importlib.metadata as m, json; print(json.dumps("
        "{d.metadata['Name'].lower(): d.requires or [] for d in m.distributions()}))"
    )
    return json.loads(subprocess.check_output([str(python), "-c", script], text=True, cwd="/"))


def test_the_sdk_installs_with_websockets_alone(sdk_venv: Path) -> None:
    distributions = installed(sdk_venv)
    assert [r.split(">")[0].split("<")[0] for r in distributions["tokend-client"]] == ["websockets"]
    # What a fresh environment has (pip, and setuptools where Python still ships it),
    # the SDK and websockets: nothing else came with it.
    assert set(distributions) - {"pip", "setuptools"} == {"tokend-client", "websockets"}
    server = subprocess.run([str(sdk_venv), "-c", "import tokend"], capture_output=True, cwd="/")
    assert server.returncode == 1 and b"No module named 'tokend'" in server.stderr


def test_its_example_holds_a_session_against_tokend_serve(sdk_venv: Path, tmp_path: Path) -> None:
    env = {**CLEAN_ENV, "TOKEND_DATA_DIR": str(tmp_path / "data"), **CLOCKS}
    server = TokendProcess(env)
    server.start()
    try:
        issued = tokend("issue", "--sub", "alice", env=env)
        assert issued.returncode == 0, issued.stderr
        url = f"ws://127.0.0.1:{server.port}/v1/ws"
        example = [str(sdk_venv), "-m", "tokend_client.example", issued.stdout]
        held = subprocess.run(
            [*example, "--url", url, "--seconds", "4"],
            env=CLEAN_ENV,
            cwd="/",  # nothing of the checkout on the path
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        assert server.stop() == 0
    assert held.returncode == 0, held.stderr
    lines = held.stdout.splitlines()
    kinds = [line.split()[1] for line in lines[1:-1]]
    assert lines[0].startswith("session ") and "of 'alice', heartbeat every 0.5 s" in lines[0]
    assert kinds[0] == "connected" and kinds[-1] == "ended", held.stdout
    assert kinds.count("renewed") >= 1 and "logged out (BYE)" in lines[-2]
    heartbeats, acks, renewals = (int(word) for word in lines[-1].split()[::2])
    assert heartbeats >= 6 and acks >= 6 and renewals == kinds.count("renewed")


def test_the_server_wheel_built_from_the_dockerfile_copies_carries_the_sdk(
    tmp_path: Path,
) -> None:
    context = tmp_path / "context"
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            *sources, target = shlex.split(line.removeprefix("COPY "))
            for source in sources:
                into = context / (target if target not in ("./", ".") else source)
                if (ROOT / source).is_dir():
                    shutil.copytree(
                        ROOT / source, into, ignore=shutil.ignore_patterns("__pycache__")
                    )
                else:
                    into.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(ROOT / source, context / source)
    wheel = build_wheel(context, tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    sdk_files = {
        f"tokend_client/{p.name}" for p in (SDK / "tokend_client").iterdir() if p.is_file()
    }
    assert sdk_files and sdk_files <= names
    assert "tokend/__main__.py" in names and "tokend/core/protocol.py" in names
