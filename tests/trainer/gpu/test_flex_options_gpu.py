"""The measured flex kernel_options (trainer.model.flex.SM90_KERNEL_OPTIONS) on the GPU: on Hopper the target's
doc-causal attention runs them at every head dim they are set for, and computes the same attention as the
reference (the drafter's: tests/trainer/gpu/test_flex_gpu.py); and `python -m bench.attention` times them."""
import json

import pytest
import torch
import torch.nn.functional as F

from bench.attention import main as bench_attention
from tests.trainer.gpu.test_flex_gpu import DEV, rel
from trainer.model.doc_attention import DocCausalMask, doc_causal_attention
from trainer.model.flex import SM90_KERNEL_OPTIONS, tuned_options

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("head_dim", sorted(SM90_KERNEL_OPTIONS["target"]))
def test_target_options_compute_doc_causal_attention(head_dim):
    rows, seq = 2, 512
    doc_ids = torch.cat([torch.zeros(rows, 200), torch.ones(rows, seq - 200)], dim=1).to(DEV, torch.int32)
    block_mask = DocCausalMask(rows, seq, DEV).update_(doc_ids)
    torch.manual_seed(0)
    q = torch.randn(rows, 8, seq, head_dim, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(rows, 2, seq, head_dim, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if HOPPER:
        assert tuned_options("target", q) == SM90_KERNEL_OPTIONS["target"][head_dim]
    got = doc_causal_attention(None, q, k, v, block_mask)[0].transpose(1, 2)  # the target layers' own call
    pos = torch.arange(seq, device=DEV)
    dense = ((pos[None, :] <= pos[:, None]) & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    low = F.scaled_dot_product_attention(q, kk, vv, attn_mask=dense)
    ref = F.scaled_dot_product_attention(q.double(), kk.double(), vv.double(), attn_mask=dense)
    assert rel(got, ref) <= max(2 * rel(low, ref), 1e-2)


def test_bench_attention_times_the_trainer_choice(capsys):
    assert bench_attention(["--shape", "small", "--batch", "1", "--seq", "512", "--anchors", "32", "--reps", "2",
                            "--only", "tuned,f128x64s3w4,b64x64s3w4"]) == 0
    rows = [json.loads(line[5:]) for line in capsys.readouterr().out.splitlines() if line.startswith("ATTN {")]
    by = {(r["attention"], r["config"]): r for r in rows}
    assert {("drafter", "default"), ("drafter", "tuned"), ("drafter", "b64x64s3w4"), ("target", "tuned")} <= set(by)
    for r in rows:
        # the same attention and gradients, up to bf16 rounding in another summation order
        assert "error" not in r and r["fwd_ms"] > 0 and r["rel_diff_vs_default"] < 0.02, r
    assert all(r["bwd_ms"] > 0 for r in rows if r["attention"] == "drafter")
