"""DFlash2's objective and training path: the selector weight's schedule, the selector CE against a plain reference
(full logits, torch.topk, F.cross_entropy) with its gradients and stop-gradient, the chunked top-k, a tiny DFlash2
run through the real build / loop (loss falls, every DFlash2 parameter trains), and the CLI's one-line refusals of
what a DFlash2 config cannot run, before torch."""
from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.conftest import small_cfg
from tests.trainer.test_cli import imported, run_cli
from trainer.model.loss import chunked_lm_loss
from trainer.model.selector import CandidateSelector, transform_unary
from trainer.model.selector_loss import selector_loss, selector_objective, selector_weight_at


def test_the_selector_weight_is_zero_in_warm_up_then_ramps_linearly_to_alpha():
    at = [selector_weight_at(s, total_steps=20, alpha=0.5, warmup_ratio=0.1, ramp_ratio=0.2) for s in range(8)]
    assert at == [0.0, 0.0, 0.125, 0.25, 0.375, 0.5, 0.5, 0.5]
    assert selector_weight_at(0, total_steps=10, alpha=2.0, warmup_ratio=0.0, ramp_ratio=0.0) == 2.0


def _case(seed, M=30, D=12, V=50, K=6):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, D, generator=g, dtype=torch.float64)
    W = torch.randn(V, D, generator=g, dtype=torch.float64)
    logits = h @ W.t()
    top = logits.topk(K, dim=-1).indices
    # half the labels among the candidates, half anywhere
    labels = torch.where(torch.rand(M, generator=g) < 0.5, top[torch.arange(M), torch.randint(0, K, (M,), generator=g)],
                         torch.randint(0, V, (M,), generator=g))
    pred = torch.randint(0, V, (M,), generator=g)
    s = torch.rand(M, generator=g, dtype=torch.float64)
    torch.manual_seed(seed)
    sel = CandidateSelector(D, V, 4, K).double()
    with torch.no_grad():
        sel.successor_codebook.normal_()
    return h, W, labels, pred, s, sel, K


def reference(sel, h, W, labels, pred, s, K, mult, cap):
    logits = transform_unary(h @ W.t(), mult, cap).double()
    unary, cand = logits.topk(K, dim=-1)
    loss = h.new_zeros(())
    for m in range(h.shape[0]):
        if labels[m] in cand[m]:
            scores = sel.score(cand[m], unary[m], h[m], pred[m])
            target = (cand[m] == labels[m]).nonzero()[0, 0]
            loss = loss + s[m] * torch.nn.functional.cross_entropy(scores[None], target[None])
    return loss


@pytest.mark.parametrize("mult,cap", [(1.0, None), (0.7, 3.0)])
def test_the_selector_loss_and_its_gradients_are_the_plain_rules(mult, cap):
    h, W, labels, pred, s, sel, K = _case(1)
    cand = (h @ W.t()).topk(K, dim=-1).indices
    h1 = h.clone().requires_grad_(True)
    term = selector_loss(sel, h1, W, None, cand, labels, pred, s, chunk=7, multiplier=mult, softcap=cap)
    term.loss.backward()
    got = {n: p.grad.clone() for n, p in sel.named_parameters()}
    sel.zero_grad()
    h2 = h.clone().requires_grad_(True)
    want = reference(sel, h2, W, labels, pred, s, K, mult, cap)
    want.backward()
    # the unary logits are fp32, as the head's CE computes them
    assert torch.allclose(term.loss.double(), want, rtol=1e-5) and torch.allclose(h1.grad, h2.grad, atol=1e-5)
    assert all(torch.allclose(got[n], p.grad, atol=1e-5) for n, p in sel.named_parameters())
    assert torch.equal(term.covered, (cand == labels[:, None]).any(-1)) and 0 < term.covered.sum() < len(labels)


def test_stop_gradient_keeps_the_selector_term_off_the_hidden_states():
    h, W, labels, pred, s, sel, K = _case(2)
    cand = (h @ W.t()).topk(K, dim=-1).indices
    h1 = h.clone().requires_grad_(True)
    term = selector_loss(sel, h1, W, None, cand, labels, pred, s, chunk=8, stop_gradient=True)
    term.loss.backward()
    assert h1.grad is None and sel.successor_codebook.grad.abs().sum() > 0


def test_the_ce_chunks_hand_back_each_positions_top_k_and_the_same_loss():
    h, W, labels, _, s, _, K = _case(3)
    loss, correct = chunked_lm_loss(h, W, None, labels, s, chunk=7)
    loss2, correct2, cand = chunked_lm_loss(h, W, None, labels, s, chunk=7, top_k=K)
    assert torch.equal(loss, loss2) and torch.equal(correct, correct2)
    assert torch.equal(cand, (h @ W.t()).topk(K, dim=-1).indices)


def metrics(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_a_tiny_dflash2_run_trains_end_to_end_on_cpu(tmp_path, tiny_target_dir):
    from trainer.build import build
    from trainer.eval import evaluate_run
    from trainer.export import load_exported
    from trainer.loop import TrainLoop
    from trainer.train import finish

    cfg = small_cfg(tiny_target_dir, "model.drafter=dflash2", "model.dflash2.selector_rank=8",
                    "loss.selector_warmup_ratio=0", "loss.selector_ramp_ratio=0", "optim.max_steps=30", "log.every=5",
                    "optim.lr=3e-3", "optim.warmup_ratio=0.05", "data.rows_per_step=4", "data.num_anchors=16")
    session = build(cfg, tmp_path / "run")
    drafter = session.state.drafter
    fresh = {n: p.detach().clone() for n, p in drafter.named_parameters() if "conv" in n or "selector" in n}
    loop = TrainLoop(session)
    result = finish(session, loop, loop.run())
    # the export is the trained DFlash2 drafter (bf16-rounded), and the simulated tau runs on it
    back, ecfg = load_exported(result.export)
    assert ecfg.drafter.dflash2 == drafter.cfg.dflash2 and set(back.state_dict()) == set(drafter.state_dict())
    assert 1.0 <= evaluate_run(tmp_path / "run", rows=session.datasets.eval)["tau"] <= cfg.model.block_size
    got = metrics(tmp_path / "run")
    assert got[30]["loss"] < 0.8 * got[5]["loss"], got
    assert session.state.selector_weight_.item() == 1.0
    moved = {n: not torch.equal(p.detach(), fresh[n]) for n, p in drafter.named_parameters() if n in fresh}
    assert len(moved) == 4 * 2 + 3 and all(moved.values()), moved
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["drafter"] == "dflash2"


@pytest.mark.parametrize("sets, message", [
    (("model.dflash2.selector_top_k=4",), "error: model.dflash2.selector_top_k is a DFlash2 option and "
                                          "model.drafter=dflash"),
    (("loss.selector_alpha=0.5",), "error: loss.selector_alpha is a DFlash2 option and model.drafter=dflash"),
    (("model.drafter=dflash2", "model.dflash2.conv_kernel_size=17"),
     "error: model.dflash2.conv_kernel_size=17 is longer than the block (model.block_size=16)"),
    (("model.drafter=dflash2", "model.dflash2.conv_group_size=24"),
     "error: model.dflash2.conv_group_size=24 does not divide the drafter's width (the target's hidden size 64)"),
    (("model.drafter=dflash2", "model.dflash2.selector_top_k=100000"),
     "error: model.dflash2.selector_top_k=100000 is more than the target's vocabulary"),
])
def test_what_a_dflash2_drafter_cannot_run_is_one_line_exit_2_before_torch(tmp_path, tiny_target_dir, sets, message):
    args = [x for s in (f"model.target={tiny_target_dir}", *sets) for x in ("--set", s)]
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), *args, flags=("-X", "importtime"))
    errors = [ln for ln in p.stderr.splitlines() if not ln.startswith(("import time:", "hint:"))]
    assert p.returncode == 2 and len(errors) == 1 and message in errors[0], p.stderr[-2000:]
    assert "torch" not in imported(p.stderr) and not (tmp_path / "r").exists()


def test_the_loop_feeds_the_scheduled_weight_to_the_step(tmp_path, tiny_target_dir):
    """Weight 0 through the whole run (warm-up 1): the selector term adds no gradient and the zero-initialized
    successor codebook stays 0; from the first step on (warm-up 0): it trains. (A wide top-k: a fresh drafter's
    labels must be among the candidates for the term to have examples.)"""
    from trainer.build import build
    from trainer.loop import TrainLoop

    def successor_after(name, warmup):
        cfg = small_cfg(tiny_target_dir, "model.drafter=dflash2", "model.dflash2.selector_rank=8", "optim.max_steps=2",
                        "model.dflash2.selector_top_k=128", f"loss.selector_warmup_ratio={warmup}",
                        "loss.selector_ramp_ratio=0")
        session = build(cfg, tmp_path / name)
        TrainLoop(session).run()
        return session.state.selector_weight_.item(), session.state.drafter.candidate_selector.successor_codebook

    weight, codebook = successor_after("off", 1.0)
    assert weight == 0.0 and not codebook.any()
    weight, codebook = successor_after("on", 0.0)
    assert weight == 1.0 and codebook.any()


def test_the_tiny_targets_width_is_checked_before_it_is_built():
    from trainer.config import load_config
    from trainer.errors import ConfigError
    from trainer.targetdir import check_target_dir

    check_target_dir(load_config("smoke", ["model.drafter=dflash2"]))  # 16 divides the tiny target's 64
    with pytest.raises(ConfigError, match=r"conv_group_size=24 does not divide the drafter's width .* 64\)"):
        check_target_dir(load_config("smoke", ["model.drafter=dflash2", "model.dflash2.conv_group_size=24"]))


@pytest.mark.parametrize("autocast", [False, True])
def test_a_bf16_head_and_hidden_states_drive_the_fp32_selector(autocast):
    """The step's dtypes: the head and the hidden states in bf16 (a CUDA run's target), the selector's parameters
    fp32 masters; with the step's autocast (here CPU's bf16) or without it. Close to the fp32 term."""
    import contextlib

    h, W, labels, pred, s, sel, K = _case(4)
    sel = sel.float()
    cand = (h @ W.t()).topk(K, dim=-1).indices
    want = selector_loss(sel, h.float(), W.float(), None, cand, labels, pred, s.float(), chunk=8).loss
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    hb = h.bfloat16().requires_grad_(True)
    with ctx:
        got = selector_loss(sel, hb, W.bfloat16(), None, cand, labels, pred, s.float(), chunk=8).loss
    got.backward()
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=0.05) and hb.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("autocast, stop_gradient", [(False, False), (True, False), (False, True)])
def test_the_compiled_selector_loss_the_compile_modes_install_is_the_eager_one(autocast, stop_gradient):
    """compile_step's copy of selector_objective (Inductor, CPU here, one graph: fullgraph) against eager: the same
    loss, coverage, picks and gradients (hidden states and selector), with the step's autocast (CPU's bf16) or
    without it, with stop_gradient; chunks 8, 8, 8, 6 (two chunk shapes in one graph)."""
    import contextlib

    h, W, labels, pred, s, sel, K = _case(5)
    sel, h, W, s = sel.float(), h.float(), W.float(), s.float()
    cand = (h @ W.t()).topk(K, dim=-1).indices
    compiled = torch.compile(selector_objective, dynamic=False, fullgraph=True)
    results = []
    for fn in (None, compiled):
        sel.zero_grad()
        h1 = h.clone().requires_grad_(True)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            term = selector_loss(sel, h1, W, None, cand, labels, pred, s, chunk=8, multiplier=0.7, softcap=3.0,
                                 stop_gradient=stop_gradient, objective=fn)
        term.loss.backward()
        results.append((term, h1.grad, {n: p.grad.clone() for n, p in sel.named_parameters()}))
    (want, want_dh, want_dp), (got, got_dh, got_dp) = results
    tol = dict(rtol=2e-2, atol=1e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, **tol)
    assert torch.equal(got.covered, want.covered) and torch.equal(got.correct, want.correct)
    assert (got_dh is None) == (want_dh is None) == stop_gradient
    if not stop_gradient:
        torch.testing.assert_close(got_dh, want_dh, **tol)
    for n, g in want_dp.items():
        torch.testing.assert_close(got_dp[n], g, **tol)
    assert got_dp["successor_codebook"].abs().sum() > 0
