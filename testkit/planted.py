"""Known defects planted in a copy of the tokend package, for the fault run's checker to
catch (tests/test_faults_checker.py; ``load_tests/faults.py --plant NAME``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import tokend

# Each defect: the edits (file under tokend/, text, replacement) that make it.
DEFECTS: dict[str, list[tuple[str, str, str]]] = {
    # A resume does not ask whether the token was revoked: neither the tombstone in Redis
    # nor the revocations the node heard.
    "resume_skips_revocation": [
        ("store/lua/hello.lua", "  if tomb then\n", "  if tomb and tomb ~= ENDED.REVOKED then\n"),
        ("store/revocations.py", "        store.known_revoked = self.knows\n", ""),
    ],
    # The heartbeat script does not compare the session's connection with the sender's.
    "heartbeat_skips_cas": [
        ("store/lua/heartbeat.lua", "  if not s or s.conn ~= conn then\n", "  if not s then\n"),
    ],
    # Every event is added to the durable stream twice.
    "event_twice": [
        (
            "store/lua/_prelude.lua",
            "  redis.call('XADD', STREAM, 'MAXLEN', '~', MAXLEN, '*', 'event', json)\n",
            "  redis.call('XADD', STREAM, 'MAXLEN', '~', MAXLEN, '*', 'event', json)\n" * 2,
        ),
    ],
}


def planted_copy(defect: str, directory: Path) -> Path:
    """A copy of the tokend package under ``directory`` with ``defect`` planted; the
    directory to put first on PYTHONPATH."""
    package = Path(tokend.__file__).parent
    target = directory / "tokend"
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text, replacement in DEFECTS[defect]:
        path = target / name
        source = path.read_text()
        if source.count(text) != 1:
            raise ValueError(f"{defect}: {name} does not hold {text!r} once")
        path.write_text(source.replace(text, replacement))
    return directory
