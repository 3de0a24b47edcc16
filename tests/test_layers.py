"""The package layout is the architecture (docs/architecture.md): every module of tokend/
belongs to one layer, imports only its own layer or lower ones, and the core is pure."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tokend"

# Lowest first. A module may import from its own layer and the layers before it.
LAYERS = ("foundation", "core", "tokens", "edge", "store", "server", "ops", "cli")
# The modules at the top of the package: what every layer may use.
FOUNDATION = {"tokend", "tokend.config", "tokend.logs", "tokend.metrics"}
# What the pure core must never import: it is driven by bytes, answers and a clock.
IMPURE = {"asyncio", "socket", "ssl", "websockets", "redis", "uvloop", "selectors", "threading"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    if module in FOUNDATION:
        return "foundation"
    if module == "tokend.__main__":
        return "cli"
    layer = module.split(".")[1]
    if layer not in LAYERS:
        raise AssertionError(f"{module}: in no layer; place it in one of {LAYERS}")
    return layer


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, wherever the import stands (a function, a
    TYPE_CHECKING block), as absolute dotted names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            found.append((node.lineno, node.module))
            if node.module == "tokend":  # from tokend import config
                found += [(node.lineno, f"tokend.{alias.name}") for alias in node.names]
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    assert MODULES
    for path in MODULES:
        layer_of(module_name(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda path: module_name(path))
def test_no_import_runs_upward(path: Path) -> None:
    here = LAYERS.index(layer_of(module_name(path)))
    upward = [
        f"line {line}: {target} ({layer_of(target)})"
        for line, target in imports_of(path)
        if target.startswith("tokend.") and LAYERS.index(layer_of(target)) > here
    ]
    assert upward == [], f"{module_name(path)} ({LAYERS[here]}) imports upward"


@pytest.mark.parametrize(
    "path",
    [path for path in MODULES if layer_of(module_name(path)) == "core"],
    ids=lambda path: module_name(path),
)
def test_the_core_does_no_io(path: Path) -> None:
    impure = [
        f"line {line}: {target}"
        for line, target in imports_of(path)
        if target.split(".")[0] in IMPURE
    ]
    assert impure == []


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The checks read real imports: a core module that imports the server is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("import asyncio\nfrom tokend.server.node import Node\n")
    targets = [target for _, target in imports_of(probe)]
    assert "tokend.server.node" in targets and "asyncio" in targets
    assert LAYERS.index(layer_of("tokend.server.node")) > LAYERS.index("core")
