"""The tree type-checks: mypy with the configuration in pyproject.toml ([tool.mypy]:
strict on the core and the Protocol seams, every function body checked elsewhere), and
few silenced errors, each saying why."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
# At most this many errors silenced in what mypy checks, each with its code and reason.
MOST_IGNORES = 5
IGNORE = re.compile(r"#\s*type:\s*ignore\b(\[[\w,-]+\])?(.*)$")


def test_mypy_passes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_few_errors_are_silenced_each_with_its_reason() -> None:
    checked = [path for top in CONFIG["files"] for path in sorted((ROOT / top).rglob("*.py"))]
    ignores = [
        (f"{path.relative_to(ROOT)}:{number}", match)
        for path in checked
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if (match := IGNORE.search(line))
    ]
    assert len(ignores) <= MOST_IGNORES, [where for where, _ in ignores]
    for where, match in ignores:
        code, reason = match[1], match[2].strip(" #-")
        assert code and reason, f"{where}: a type: ignore names its error code and why"


def test_the_strict_modules_get_every_check_strict_mode_enables() -> None:
    """strict = true in an override would hold every module to it, so the strict modules'
    override spells out what ``mypy --strict`` enables (mypy --help lists it); the
    checks mypy takes only for every module are set for every module."""
    usage = subprocess.run(
        [sys.executable, "-m", "mypy", "--help"], capture_output=True, text=True, check=True
    ).stdout
    listed = re.search(r"Strict mode; enables the following flags:(.*?)\n  --", usage, re.S)
    assert listed, "mypy --help no longer lists what --strict enables"
    flags = re.findall(r"--([a-z-]+)", re.sub(r"-\n\s+", "-", listed[1]))
    assert "disallow-untyped-defs" in flags, flags
    expected = {
        flag.removeprefix("no-").replace("-", "_"): not flag.startswith("no-") for flag in flags
    }
    (strict,) = [o for o in CONFIG["overrides"] if "tokend.core.*" in o["module"]]
    given = {**{k: v for k, v in CONFIG.items() if isinstance(v, bool)}, **strict}
    assert {flag: given.get(flag) for flag in expected} == expected
