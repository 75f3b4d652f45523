"""Static decoding on CUDA with graph replay (run on the H200: `python3 -m pytest -m gpu tests/trainer/decode`)."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.decode.test_static_decode import _WrongAt, _sharp_drafter
from tests.trainer.decode.test_reference import PROMPTS, _prompt_ids
from trainer.decode.engine import StaticDecoder
from trainer.decode.static_draft import StaticDFlashProposer, TableProposer
from trainer.decode.reference import DFlashProposer, generate_speculative, generate_target_only

pytestmark = pytest.mark.gpu


class LogitRecorder(DFlashProposer):
    """The HF reference proposer, keeping every round's draft logits (its drafts are their argmax)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: list[torch.Tensor] = []

    def propose(self, new_feats, committed):
        logits = self.draft_logits(new_feats, committed).float()
        self.logits.append(logits)
        return logits.argmax(-1)

    @property
    def drafts(self) -> list[list[int]]:
        return [row.argmax(-1).tolist() for row in self.logits]


# A bf16 near-tie: the reference's logit for its own draft exceeds its logit for the engine's by at most this share of
# the row's largest logit. bf16 keeps 8 significant bits (a relative step of 2^-8), and the rounding differences of a
# few such steps in the drafter's hidden state move a logit by a few steps of its scale.
NEAR_TIE = 2.0 ** -5


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_graph_replay_equals_hf_reference(cuda_target, autocast):
    """Graph-replayed target-only decoding == HF greedy, and so is graph-replayed speculative decoding (fp32 target,
    exact). The drafts equal the HF reference's round by round: exactly with an fp32 drafter. Under bf16 autocast (as
    trained) the masked static attention and the reference's concatenation round differently in the last bits, so a
    draft may differ where the reference's two candidates are a near-tie: at the first round that differs (after it
    the rounds start at other positions), every differing draft is one."""
    drafter = _sharp_drafter(cuda_target, seed=5).cuda()
    gaps = []
    for B in (4, 16):
        proposer = StaticDFlashProposer(cuda_target, drafter, B, slots=192, autocast=autocast)
        decoder = StaticDecoder(cuda_target, 192, proposer, B)
        assert decoder.round.graph is not None and decoder.step.graph is not None
        for text in PROMPTS:
            ids = _prompt_ids(cuda_target, text)
            want = generate_target_only(cuda_target, ids, 41)
            assert decoder.generate_target_only(ids, 41) == want
            drafts: list = []
            assert decoder.generate_speculative(ids, 41, drafts=drafts).tokens == want
            reference = LogitRecorder(cuda_target, drafter, B, autocast=autocast)
            assert generate_speculative(cuda_target, reference, ids, 41).tokens == want
            if not autocast:
                assert drafts == reference.drafts, (B, text)
                continue
            first = next((r for r, (a, b) in enumerate(zip(drafts, reference.drafts)) if a != b), None)
            if first is None:
                continue
            logits = reference.logits[first]
            for j, (mine, theirs) in enumerate(zip(drafts[first], reference.drafts[first])):
                if mine != theirs:
                    gaps.append(float((logits[j, theirs] - logits[j, mine]) / logits[j].abs().max()))
    print("bf16" if autocast else "fp32", "near-tie gaps", gaps)
    assert all(gap <= NEAR_TIE for gap in gaps), gaps


def test_graph_round_bookkeeping_with_known_answers(cuda_target):
    """Perfect table drafter: tau = B under replay; one wrong position k: every round accepts k - 1."""
    B = 16
    for text in PROMPTS:
        ids = _prompt_ids(cuda_target, text)
        greedy = generate_target_only(cuda_target, ids, 40 + B)
        table = torch.tensor(ids + greedy, device="cuda")
        perfect = StaticDecoder(cuda_target, 128, TableProposer(table, B), B).generate_speculative(ids, 40)
        assert perfect.tokens == greedy[:40] and set(perfect.accepted[:-1]) == {B - 1}
        vocab = cuda_target.embed_tokens.weight.shape[0]
        wrong = StaticDecoder(cuda_target, 128, _WrongAt(table, B, 5, vocab), B).generate_speculative(ids, 40)
        assert wrong.tokens == greedy[:40] and set(wrong.accepted) == {4}


@pytest.mark.parametrize("compile", ["drafter", "all"])
def test_compiled_round_equals_reference(cuda_target, compile):
    """torch.compile'd step and round forwards (inside the same raw graphs) decode the same tokens."""
    drafter = _sharp_drafter(cuda_target, seed=5).cuda()
    decoder = StaticDecoder(cuda_target, 128, StaticDFlashProposer(cuda_target, drafter, 16, 128), 16,
                            compile=compile)
    for text in PROMPTS:
        ids = _prompt_ids(cuda_target, text)
        want = generate_target_only(cuda_target, ids, 33)
        assert decoder.generate_target_only(ids, 33) == want
        assert decoder.generate_speculative(ids, 33).tokens == want


def test_batched_continuations_under_graph_replay(cuda_target):
    """BatchGenerator on equal-length windows (the regen stage's continuation engine): one replay per token for the
    whole batch, each row the target's own greedy continuation (fp32); a smaller last batch too."""
    from trainer.decode.generate import BatchGenerator, Sampling

    torch.manual_seed(0)
    vocab = cuda_target.embed_tokens.weight.shape[0]
    prompts = torch.randint(0, vocab - 1, (6, 10)).tolist()
    gen = BatchGenerator(cuda_target, rows=4, max_len=22, stop_ids=[])
    twelve = Sampling(max_new_tokens=12)
    got = gen.generate(prompts[:4], twelve) + gen.generate(prompts[4:], twelve)
    assert all(p.graph is not None for p in gen.programs.values())
    for row, prompt in zip(got, prompts):
        assert row == generate_target_only(cuda_target, prompt, 12)


def _quality_shaped_bf16_target():
    """A random target of the quality recipe's shape in bf16: the shapes whose cuBLAS kernels were measured to give
    the same rows at M = 1 and M = 16 (the tiny test target's shapes were not)."""
    from bench.decode import random_pair

    target, _, _ = random_pair(torch.device("cuda"), 16, torch.bfloat16, num_layers=8)
    return target


def test_row_invariant_rmsnorm_on_cuda():
    """One row normalized alone == the same row among 16 or 128, bitwise, in bf16 and fp32; and close to HF's."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from trainer.decode.kernels import RowInvariantRMSNorm

    for dtype in (torch.bfloat16, torch.float32):
        for width, rows in ((512, 16), (64, 128)):
            torch.manual_seed(width)
            module = Qwen3RMSNorm(width, eps=1e-6).to("cuda", dtype)
            module.weight.data.normal_(1.0, 0.2)
            norm = RowInvariantRMSNorm(module)
            x = torch.randn(rows, width, device="cuda", dtype=dtype) * 3
            assert norm.uses_kernel(x)
            together = norm(x)
            alone = torch.cat([norm(x[r:r + 1]) for r in range(rows)])
            assert torch.equal(together, alone)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(together, module(x), rtol=tol, atol=tol)



def test_decode_attention_kernel_on_cuda():
    """The Triton attention kernel compiled for the H200: SDPA's result (fp32), and rows independent of the batch
    (bf16, bitwise), at the quality target's head shapes over a 320-slot cache."""
    import torch.nn.functional as F

    from trainer.decode.kernels import decode_attention

    torch.manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 16, 8, 64, device="cuda", dtype=dtype).transpose(1, 2)
        k, v = (torch.randn(1, 4, 320, 64, device="cuda", dtype=dtype) for _ in range(2))
        pos = torch.arange(200, 216, device="cuda")
        got = decode_attention(q, k, v, pos, 0.125)
        alone = torch.cat([decode_attention(q[:, :, j:j + 1], k, v, pos[j:j + 1], 0.125) for j in range(16)], 1)
        assert torch.equal(got, alone)
        if dtype == torch.float32:
            visible = (torch.arange(320, device="cuda")[None] <= pos[:, None])[None, None]
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.125, enable_gqa=True)
            torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_bf16_verify_rows_equal_decode_steps_bitwise():
    """The lossless property at its root, for the invariant engine: a 16-token forward computes each token's logits
    and tapped features bitwise as 16 successive 1-token forwards do, in bf16 (where rounding differences would flip
    near-ties). Failed with SDPA in bf16 (the first row's logits, in their last bits), which the Triton attention
    kernel replaces here."""
    from trainer.decode.stack import StaticTarget

    target = _quality_shaped_bf16_target()
    static = StaticTarget(target, slots=256, invariant=True)
    torch.manual_seed(1)
    prompt = torch.randint(0, 8000, (1, 100), device="cuda")
    at = lambda p: torch.tensor(p, device="cuda")  # noqa: E731
    logits, _ = static.forward(prompt, at(0))
    token = logits[0, -1].argmax()
    tokens, steps = [], []
    for j in range(16):
        tokens.append(token)
        step_logits, step_feats = static.forward(token.view(1, 1), at(100 + j))
        steps.append((step_logits[0, 0].clone(), step_feats[0, 0].clone()))
        token = step_logits[0, 0].argmax()
    block_logits, block_feats = static.forward(torch.stack(tokens).view(1, 16), at(100))
    for j, (want_logits, want_feats) in enumerate(steps):
        assert torch.equal(block_logits[0, j], want_logits), j
        assert torch.equal(block_feats[0, j], want_feats), j


def test_bf16_speculative_equals_target_only_under_graph_replay():
    """bf16 target, invariant engine, both decoders graph-replayed: speculative output == target-only output token for
    token, with drafts right up to a fixed position (so every verify block mixes accepted and rejected tokens)."""
    target = _quality_shaped_bf16_target()
    B = 16
    torch.manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, 8000, (60,)).tolist()
        greedy = StaticDecoder(target, 320, None, B, invariant=True).generate_target_only(ids, 160 + B)
        table = torch.tensor(ids + greedy, device="cuda")
        for wrong_at in (3, 9):
            decoder = StaticDecoder(target, 320, _WrongAt(table, B, wrong_at, 8192), B, invariant=True)
            out = decoder.generate_speculative(ids, 160)
            assert out.tokens == greedy[:160] and set(out.accepted[:-1]) == {wrong_at - 1}
