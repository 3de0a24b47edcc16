"""Load and capacity runs (soak.py, overload.py, run.py), each run as a script from a
checkout: it puts the repository root on ``sys.path`` first, for testkit/, bench/ and
load_tests/ itself. locustfile.py, run by locust (and in the load image), needs only
tokend."""
