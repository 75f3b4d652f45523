"""trainer.model.flex's measured kernel_options table: names torch's flex attention knows, tiles that divide the
masks' sparse blocks, one kernel per prefix; and off wherever the GPU is not Hopper (here: the CPU)."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import FlexKernelOptions

from trainer.model.doc_attention import TILE, DocCausalMask
from trainer.model.flex import SM90_KERNEL_OPTIONS, BlockLayoutShape, FlexBlockMask, tuned_options

ENTRIES = [(att, hd, opts) for att, by_hd in SM90_KERNEL_OPTIONS.items() for hd, opts in by_hd.items()]


@pytest.mark.parametrize("attention, head_dim, options", ENTRIES)
def test_each_option_is_a_flex_option_for_one_kernel(attention, head_dim, options):
    assert options, (attention, head_dim)
    for key, value in options.items():
        prefix, _, name = key.partition("_")
        assert prefix in ("fwd", "bwd") and name in FlexKernelOptions.__annotations__, key
        if name.startswith("BLOCK_"):
            # flex refuses a kernel tile that does not divide the BlockMask's sparse block
            assert TILE % value == 0 and value >= 16, key
        if attention == "target":
            assert prefix == "fwd", "the frozen target runs no attention backward"


def test_the_cpu_runs_torch_defaults():
    FlexBlockMask(BlockLayoutShape(1, 128, 8, 16), "cpu")
    DocCausalMask(1, 128, "cpu")
    for attention, head_dim, _ in ENTRIES:
        q = torch.zeros(1, 1, 16, head_dim, dtype=torch.bfloat16)
        assert tuned_options(attention, q) is None
