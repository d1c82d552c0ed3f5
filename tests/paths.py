"""Where the repository is, for tests that read its files or start its programs (one home for it)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
