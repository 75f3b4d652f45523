"""Decoding tests run tiny models: one intra-op thread is ~10x faster than two on a shared 2-core box."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")  # module: also covers module-scoped fixtures
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
