"""Where the tests find the repository's files and their own helpers, wherever a test file sits."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # helpers, peers and fixtures (on sys.path: pyproject's pythonpath)
REPO = SUPPORT.parents[1]  # the clone: examples/, ops/, docs/
