"""The 2026 families on the GPU (run on the H200: pytest -m gpu tests/trainer/gpu; needs fla-core installed): fla's
chunked kernels with the document reset equal the exact torch rule on packed rows; the tiny hybrid, MoE and
attention-sink targets (tests/trainer/families.py, saved to disk, loaded through `load_target`) give HF's features
per document through the CUDA fast path, and train with step.mode=compile+graph (fla's custom op, the
grouped expert GEMMs, the sinks and, under model.target_fp8, the FP8 linears inside the captured step)."""
import json

import pytest
import torch

from tests.trainer.conftest import small_cfg
from tests.trainer.test_families import hf_taps, packed_row
from tests.trainer.test_linear_attention import ROWS, SEQ, doc_ids_of, rule_inputs

pytestmark = pytest.mark.gpu
FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe", "gpt_oss", "qwen3_moe")


def test_fla_with_the_document_reset_equals_the_exact_rule():
    from trainer.model.linear_attention import doc_starts, fla_available, gated_delta_rule

    assert fla_available(), "the gpu tier needs fla-core (pip install fla-core einops)"
    starts = doc_starts(doc_ids_of(ROWS, SEQ)).cuda()
    q, k, v, g, beta = (x.cuda() for x in rule_inputs(len(ROWS), SEQ, hk=2, hv=4, dk=64, dv=64))
    want = gated_delta_rule(q, k, v, g, beta, starts, kernel="torch")
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2)):
        got = gated_delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), starts, kernel="fla")
        err = (got.float() - want).abs().max().item()
        assert err <= tol * want.abs().max().item(), (dtype, err)


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_features_equal_hf_per_document(family, family_dirs):
    """In fp32: in bf16 an MoE router's top-k can flip on a near tie, and one token's features then differ by more
    than any rounding (the CPU tests compare every family exactly)."""
    from trainer.model.target import load_target

    fast = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), device="cuda", dtype="float32",
                       attn="flex", truncate=False)
    hf = load_target(family_dirs[family], num_draft_layers=2, layer_ids=(1, 3), device="cuda", dtype="float32",
                     truncate=False)
    lengths = [100, 70, 64, 22]
    ids, pos, doc = (t.cuda() for t in packed_row(lengths, 256, fast.embed_tokens.weight.shape[0]))
    got = fast.features(ids, pos, doc)
    at = 0
    for n in lengths:
        want = hf_taps(hf, ids[:, at:at + n], (1, 3))
        err = (got[:, at:at + n] - want).abs().max().item()
        assert err <= 5e-3 * want.abs().max().item(), (family, n, err)  # fla's fp32 dots run as TF32
        at += n


@pytest.mark.parametrize("family, target_fp8", [(f, False) for f in FAMILIES] +
                         [(f, True) for f in ("qwen3_5", "qwen3_5_moe", "gpt_oss")])
def test_trains_with_compile_and_graph(family, target_fp8, family_dirs, tmp_path):
    """model.target_fp8 too, for a hybrid (its Gated DeltaNet projections), a hybrid MoE (its shared expert) and
    gpt-oss (biased attention with sinks): the FP8 linears inside the captured step."""
    from trainer.build import build
    from trainer.loop import TrainLoop
    from trainer.train import finish

    cfg = small_cfg(family_dirs[family], "device=cuda", "step.mode=compile+graph", "model.dtype=bfloat16",
                    "model.num_draft_layers=2", "model.target_layer_ids=[1, 3]", "data.seq_len=256",
                    "data.num_anchors=16", "optim.max_steps=6", "log.every=2", f"model.target_fp8={target_fp8}")
    session = build(cfg, tmp_path / "run")
    loop = TrainLoop(session)
    finish(session, loop, loop.run())
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(x == x for x in losses), losses
