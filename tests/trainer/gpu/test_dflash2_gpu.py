"""A DFlash2 drafter in the captured and compiled step modes against eager, on the real tiny HF target: the
convolution, the selector term and its scheduled weight (a device tensor filled before every replay: a weight baked
into the graph would give other losses) captured bit for bit."""
import pytest

from tests.trainer.gpu.test_runner_gpu import SAME_KERNELS, max_diff, train

pytestmark = pytest.mark.gpu

DFLASH2 = ("model.drafter=dflash2", "model.dflash2.conv_kernel_size=3", "model.dflash2.selector_rank=8",
           "loss.selector_warmup_ratio=0.2", "loss.selector_ramp_ratio=0.5")


@pytest.mark.parametrize("mode, ref_mode, sets", [("graph", "eager", SAME_KERNELS), ("compile+graph", "compile", ())])
def test_a_dflash2_graph_run_is_bit_exact(tmp_path, tiny_target_dir, mode, ref_mode, sets):
    ref_l, ref_p = train(tmp_path, tiny_target_dir, "ref", f"step.mode={ref_mode}", "step.attn=flex", *DFLASH2, *sets)
    got_l, got_p = train(tmp_path, tiny_target_dir, "got", f"step.mode={mode}", "step.attn=flex", *DFLASH2, *sets)
    print(mode, "losses", got_l, "max param diff", max_diff(ref_p, got_p))
    assert got_l == ref_l and max_diff(ref_p, got_p) == 0.0 and len(set(got_l)) > 1
    assert any("conv" in n for n in got_p) and "candidate_selector.successor_codebook" in got_p
