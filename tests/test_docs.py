"""What README.md and docs/*.md name exists in the tree, so that the docs stay true;
and every section of a doc that the docs or the code cite exists.

Names are read from backticks outside fenced blocks: a test (``tests/x.py::name``, and
``::name`` for another test of the file named last), a file or directory of the
repository, a dotted ``tokend.`` name (imported, and its attributes looked up), a
``TOKEND_*`` variable (a setting's), a class (``CamelCase``) and a snake_case name (a
setting, a close reason, a function, an event field, a metric...), each of which must
be defined or spelt somewhere in the code. Checked against the tree as it is when the
test runs, so a renamed module or test fails it until its docs follow.
"""

from __future__ import annotations

import builtins
import importlib
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest

from tokend import config

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where a name the docs use may be defined or spelt: the code, not the docs.
CODE_DIRS = ("tokend", "sdk", "tests", "testkit", "bench", "load_tests", "config", ".ci")
CODE_SUFFIXES = {".py", ".lua", ".js", ".ts", ".toml", ".html", ".json", ".yml", ".yaml"}
SKIPPED_DIRS = {"node_modules", "__pycache__", ".venv", ".git"}
# Top-level entries of the repository whose files the docs may name.
TREE_ROOTS = (*CODE_DIRS, "docs", "examples", "pyproject.toml", "README.md", "Dockerfile")

# Names the docs use that belong to something outside this repository: libraries, the
# kernel, Redis, the browser. Kept short on purpose: each is checked by a reader.
EXTERNAL = {
    "ServerProtocol",  # websockets' Sans-I/O server
    "CancelledError",  # asyncio
    "NamedTuple",  # typing
    "ListenOverflows",  # /proc/net/netstat
    "tcp_max_syn_backlog",  # sysctl net.ipv4
    "get_pool_name",  # redis-py's observability hook
    "send_context",  # websockets' send path
    "EdDSA",  # the JWT algorithm (RFC 8037)
    "tokend.service",  # the systemd unit docs/operations.md shows
    "hmac_digest",  # _hashlib's, as profiles name it
    "process_request",  # websockets' handshake, as profiles name it
    "parse_line",  # websockets' HTTP parser, as profiles name it
    "parse_headers",  # the same
    "read_line",  # the same
}

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
TICKED = re.compile(r"`([^`\n]+)`")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?|::([A-Za-z_]\w*)")
PATH = re.compile(r"(?:\.?[\w-]+/)+[\w.-]*")
DOTTED = re.compile(r"tokend(?:\.\w+)+")
ENV = re.compile(r"(?<![A-Z_])TOKEND_[A-Z0-9_]+")
CAMEL = re.compile(r"[A-Z][a-z]+[a-z0-9]*[A-Z][A-Za-z0-9]*")
SNAKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+")
METRIC = re.compile(r"(tokend_\w+?)(?:_total|_bucket|_count|_sum)?(?:\{[^}]*\})?")


def ticked() -> Iterator[tuple[str, str]]:
    """(doc, backticked text) of every doc, outside fenced blocks."""
    for doc in DOCS:
        text = FENCE.sub("", doc.read_text())
        for match in TICKED.finditer(text):
            yield doc.name, match.group(1).strip()


@cache
def tree_files() -> tuple[Path, ...]:
    return tuple(
        path
        for top in TREE_ROOTS
        for path in sorted([ROOT / top, *(ROOT / top).rglob("*")])
        if path.is_file() and not SKIPPED_DIRS.intersection(path.parts)
    )


@cache
def code_files() -> tuple[Path, ...]:
    return tuple(
        path
        for path in tree_files()
        if path.relative_to(ROOT).parts[0] in CODE_DIRS
        and (path.suffix in CODE_SUFFIXES or path.parent.name == ".ci")
    )


@cache
def code_text() -> str:
    return "\n".join(path.read_text(errors="replace") for path in code_files())


@cache
def code_words() -> frozenset[str]:
    return frozenset(re.findall(r"[A-Za-z_]\w*", code_text()))


def defines(text: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", text, re.MULTILINE) is not None


def named_tests() -> Iterator[tuple[str, str, str]]:
    """(doc, test file, test name) of every test a doc names; ``::name`` continues the
    file named last in that doc."""
    for doc in DOCS:
        last = ""
        for match in TEST_REF.finditer(FENCE.sub("", doc.read_text())):
            if match.group(1):
                last = match.group(1)
            name = match.group(2) or match.group(3)
            if last and name:
                yield doc.name, last, name


def missing_tests() -> list[str]:
    missing = []
    for doc, file, name in named_tests():
        path = ROOT / file
        if not path.is_file() or not defines(path.read_text(), name):
            missing.append(f"{doc}: {file}::{name}")
    return missing


def missing_paths() -> list[str]:
    missing = []
    for doc, text in ticked():
        if text.startswith("@"):
            continue  # an npm package's scoped name (@tokend/client), not a path
        for match in PATH.finditer(text.split("::")[0]):
            path = match.group(0).rstrip(".")
            if path.split("/")[0] not in TREE_ROOTS or re.search(r"[<*{]|\.\.\.", text):
                continue  # a path outside the repository, or a pattern of paths
            if not (ROOT / path).exists():
                missing.append(f"{doc}: {path}")
    return missing


def resolves(dotted: str) -> bool:
    """``tokend.a.b.C.d``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                # Instance attributes are set in __init__: spelt in the code.
                return attribute in code_words() and isinstance(found, type)
            found = getattr(found, attribute)
        return True
    return False


def spelt(name: str) -> bool:
    """A file of the tree named so, or a string of the code (a file tokend writes, the
    subprotocol): ``tokend.toml``, ``tokend.pid``, ``tokend.v1``."""
    if any(path.name == name for path in tree_files()):
        return True
    return re.search(rf"[\"'/]{re.escape(name)}[\"']", code_text()) is not None


def missing_dotted() -> list[str]:
    return [
        f"{doc}: {name}"
        for doc, text in ticked()
        for name in DOTTED.findall(text)
        if name not in EXTERNAL and not resolves(name) and not spelt(name)
    ]


def missing_settings() -> list[str]:
    """A setting's variable, or one the code reads (TOKEND_CONFIG, a test's seed)."""
    names = {config.env_name(name) for name in config.FIELDS} | code_words()
    return [
        f"{doc}: {variable}"
        for doc, text in ticked()
        for variable in ENV.findall(text)
        if variable not in names and not variable.endswith("_")
    ]


def missing_names() -> list[str]:
    """Classes and snake_case names: defined or spelt in the code, or external."""
    words = code_words()
    known = words | EXTERNAL | set(dir(builtins)) | set(config.FIELDS)
    missing = []
    for doc, text in ticked():
        metric = METRIC.fullmatch(text)
        if metric and metric.group(1) in code_text():
            continue
        if CAMEL.fullmatch(text) and text not in EXTERNAL and text not in dir(builtins):
            if not defines(code_text(), text) and f"{text} =" not in code_text():
                missing.append(f"{doc}: class {text}")
        elif SNAKE.fullmatch(text) and text not in known:
            missing.append(f"{doc}: {text}")
    return missing


# A cited section: README, "Title" or docs/x.md (§ n), "Title", in docs and code alike.
# A title starts with a word character: a list of quoted strings is not a citation.
CITED = re.compile(
    r'(README(?:\.md)?|docs/[\w-]+\.md)\s*(?:,|§\s*\d+,?)?\s*(?:section\s+)?"(\w[^"\n]*)"'
)
CITING_DIRS = ("tokend", "tests", "testkit", "sdk", "bench", "load_tests")


def anchors(doc: Path) -> list[str]:
    """What a citation may name in ``doc``: its headings (without their numbers) and
    the bold labels that open its paragraphs."""
    text = doc.read_text()
    headings = [
        re.sub(r"^#+\s*(?:\d+\.\s*)?", "", line).strip()
        for line in text.splitlines()
        if line.startswith("#")
    ]
    return [*headings, *(label.rstrip(".") for label in re.findall(r"\*\*([^*\n]+)\*\*", text))]


def missing_sections() -> list[str]:
    citing = [
        *DOCS,
        *(
            path
            for path in code_files()
            if path.relative_to(ROOT).parts[0] in CITING_DIRS and path != Path(__file__)
        ),
    ]
    missing = []
    for path in citing:
        for match in CITED.finditer(path.read_text(errors="replace")):
            name = "README.md" if match.group(1).startswith("README") else match.group(1)
            title = match.group(2).rstrip(" .…").lower()
            doc = ROOT / name
            found = doc.is_file() and any(
                title in anchor.lower() or anchor.lower() in title for anchor in anchors(doc)
            )
            if not found:
                missing.append(f"{path.relative_to(ROOT)}: {name}, {match.group(2)!r}")
    return missing


@pytest.mark.parametrize(
    "check",
    [
        missing_tests,
        missing_paths,
        missing_dotted,
        missing_settings,
        missing_names,
        missing_sections,
    ],
    ids=lambda check: check.__name__.removeprefix("missing_"),
)
def test_every_name_in_the_docs_exists(check: Callable[[], list[str]]) -> None:
    assert check() == []


def test_the_reader_finds_what_the_docs_name() -> None:
    """The parsing itself: a doc-shaped line yields each kind of name (else the checks
    above would pass on nothing)."""
    refs = list(named_tests())
    assert len(refs) > 50
    assert any(name.startswith("test_") for _, _, name in refs)
    texts = [text for _, text in ticked()]
    assert any(DOTTED.fullmatch(text) for text in texts)
    assert any(ENV.fullmatch(text) for text in texts)
    assert any(CAMEL.fullmatch(text) for text in texts)
    cites = [m for d in DOCS for m in CITED.finditer(d.read_text())]
    assert len(cites) > 10 and any(m.group(1).startswith("README") for m in cites)
    assert not resolves("tokend.core.session.NoSuchClass")
    assert not defines("def test_a(): pass", "test_ab")
