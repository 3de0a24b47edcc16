"""Real parts for tests/, bench/ and load_tests/: private redis-servers and tokend
processes on loopback ports, protocol clients, event readers, process sampling, and
the one way to wait for a condition (:func:`testkit.waiting.eventually`).

Not shipped in the wheel (``[tool.setuptools.packages.find]`` takes ``tokend*`` only):
it is imported from a checkout, where the repository root is on ``sys.path`` (pytest
puts it there for tests/, ``python -m bench`` runs from it, and each load_tests/
script puts it there first). Nothing here imports tests/ or bench/.
"""
