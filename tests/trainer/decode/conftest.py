"""Decoding tests run tiny models, like the quality tests: the same one-intra-op-thread fixture (autouse)."""
from __future__ import annotations

from tests.trainer.quality.conftest import one_thread  # noqa: F401  (a fixture: pytest collects it from here)
