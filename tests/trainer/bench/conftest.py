"""Benchmark tests run tiny models, like the decoding tests: the same one-intra-op-thread fixture (autouse)."""
from __future__ import annotations

from tests.trainer.decode.conftest import one_thread  # noqa: F401  (a fixture: pytest collects it from here)
