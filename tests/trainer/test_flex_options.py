"""trainer.model.flex's measured kernel_options table: names torch's flex attention knows, tiles that divide the
masks' sparse blocks, one kernel per prefix; and off wherever the GPU is not Hopper (here: the CPU)."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import FlexKernelOptions

from trainer.model.doc_attention import TILE, DocCausalMask
import trainer.model.flex as flex
from trainer.model.flex import (SM90_KERNEL_OPTIONS, BlockLayoutShape, FlexBlockMask, options_for, tuned_options,
                                use_tuned_options)

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


@pytest.fixture
def no_active_options(monkeypatch):
    monkeypatch.setattr(flex, "_active_options", {})


@pytest.mark.parametrize("capability, on", [((9, 0), True), ((8, 0), False), ((10, 0), False)])
def test_only_a_hopper_device_turns_them_on_and_only_for_bf16(no_active_options, monkeypatch, capability, on):
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: seen.append(index) or capability)
    use_tuned_options(torch.device("cuda", 1))
    assert seen == [1]
    for attention, head_dim, options in ENTRIES:
        got = options_for(attention, torch.device("cuda", 1), torch.bfloat16, head_dim)
        assert got == (options if on else None)
        assert options_for(attention, torch.device("cuda", 0), torch.bfloat16, head_dim) is None  # another GPU
        assert options_for(attention, torch.device("cuda", 1), torch.float32, head_dim) is None
    assert options_for("drafter", torch.device("cuda", 1), torch.bfloat16, 80) is None  # no choice: defaults


def test_the_cpu_runs_torch_defaults(no_active_options):
    FlexBlockMask(BlockLayoutShape(1, 128, 8, 16), "cpu")
    DocCausalMask(1, 128, "cpu")
    for attention, head_dim, _ in ENTRIES:
        q = torch.zeros(1, 1, 16, head_dim, dtype=torch.bfloat16)
        assert tuned_options(attention, q) is None
