"""optim.name=muon on the GPU: the captured step (graph mode) against eager, bit for bit, with one set of LM-head
kernels; every group of the combined optimizer capturable and driven by the one LR tensor."""
import pytest
import torch

from tests.trainer.gpu.test_runner_gpu import SAME_KERNELS, max_diff, train
from trainer.step.muon import MuonAdamW

pytestmark = pytest.mark.gpu


def test_muon_graph_step_is_bit_exact_against_eager(tmp_path, tiny_target_dir):
    sets = ("optim.name=muon", "step.attn=flex", *SAME_KERNELS)
    ref_l, ref_p = train(tmp_path, tiny_target_dir, "ref", "step.mode=eager", *sets)
    got_l, got_p = train(tmp_path, tiny_target_dir, "got", "step.mode=graph", *sets)
    print("muon graph losses", got_l, "max param diff", max_diff(ref_p, got_p))
    assert got_l == ref_l
    assert max_diff(ref_p, got_p) == 0.0
    assert len(set(got_l)) > 1


def test_the_muon_groups_are_capturable_with_the_one_lr_tensor(tmp_path, tiny_target_dir):
    from tests.trainer.conftest import small_cfg
    from trainer.build import build

    run = build(small_cfg(tiny_target_dir, "device=cuda", "optim.name=muon", "optim.max_steps=2"), tmp_path / "r")
    opt = run.state.optimizer
    assert isinstance(opt, MuonAdamW)
    assert all(g["capturable"] and g["lr"] is run.state.lr_ for g in opt.param_groups)
