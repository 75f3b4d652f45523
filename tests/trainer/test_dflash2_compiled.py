"""What step.mode=compile compiles of a DFlash2 step (trainer.step.policy.compile_step), read from the profiler on
the tiny target (Inductor, CPU here): the per-chunk top-k's second stage and the selector objective run inside
compiled graphs, forward and backward, not as eager ATen ops (each one a kernel launch on CUDA, ~90 a CE chunk);
the selector's codebook lookups stay eager (their backward: a deterministic sort and segment sum)."""
from __future__ import annotations

from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from tests.trainer.conftest import small_cfg

# ATen ops that only DFlash2's top-k second stage and selector objective issue in the step.
SELECTOR_OPS = {"aten::topk", "aten::sort", "aten::__xor__", "aten::__lshift__", "aten::einsum", "aten::logsumexp",
                "aten::index", "aten::argmax"}
COMPILED = ("Torch-Compiled Region", "CompiledFunction")


def eager_ops(events) -> Counter:
    """Top-level ATen ops (not called by another ATen op) outside every compiled region -> their counts."""
    out = Counter()
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent, top = e.cpu_parent, True
        while parent is not None:
            if parent.name.startswith(COMPILED) or parent.name.startswith("aten::"):
                top = False
                break
            parent = parent.cpu_parent
        if top:
            out[e.name] += 1
    return out


def test_in_compile_mode_the_selector_and_its_top_k_run_inside_compiled_graphs(tmp_path, tiny_target_dir):
    from trainer.build import build

    session = build(small_cfg(tiny_target_dir, "model.drafter=dflash2", "model.dflash2.selector_rank=8",
                              "model.dflash2.selector_top_k=4", "step.mode=compile", "step.loss_chunk=40"),
                    tmp_path / "run")
    state = session.state
    assert state.selector_objective_fn is not None and state.topk_select_fn is not None
    state.selector_weight_.fill_(1.0)
    batch = session.batches.batch(0)
    session.runner.step([batch])  # compiles
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        session.runner.step([batch])
    ops = eager_ops(prof.events())
    assert sum(ops.values()) > 0  # the step's glue (labels, weights, the CE chunk loop) stays eager
    assert {name: ops[name] for name in SELECTOR_OPS if ops[name]} == {}
    # but for the two codebook lookups' backward: eager's deterministic kernel, not Inductor's atomic scatter-add
    assert ops["aten::embedding_backward"] == 2
    # what ran them: compiled graphs, forward and backward
    names = {e.name for e in prof.events()}
    assert any(n.startswith("Torch-Compiled Region") for n in names) and "CompiledFunctionBackward" in names


def test_the_compiled_selector_loss_keeps_no_gathered_head_rows_for_its_backward():
    """The candidate logits h . W[cand] under torch.compile: the gather fused into the product's sum, so what the
    compiled graph saves for the backward holds no [positions, K, D] (or a chunk's [chunk, K, D]) gathered rows --
    the partitioner would keep every chunk's einsum operand -- and no more elements than eager's chunked form."""
    from trainer.model.selector import CandidateSelector
    from trainer.model.selector_loss import selector_loss, selector_objective

    g = torch.Generator().manual_seed(0)
    M, D, V, K, chunk = 96, 64, 512, 8, 32
    h = torch.randn(M, D, generator=g).requires_grad_(True)
    W = torch.randn(V, D, generator=g)
    cand = torch.randint(V, (M, K), generator=g)
    labels, pred, s = cand[:, 2].clone(), torch.randint(V, (M,), generator=g), torch.rand(M, generator=g)
    sel = CandidateSelector(D, V, 4, K)
    saved = {}
    for name, fn in (("eager", None), ("compiled", torch.compile(selector_objective, dynamic=False, fullgraph=True))):
        selector_loss(sel, h, W, None, cand, labels, pred, s, chunk=chunk, objective=fn)  # compiles
        shapes = saved[name] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t):
            selector_loss(sel, h, W, None, cand, labels, pred, s, chunk=chunk, objective=fn)
    assert all(shape[-2:] != (K, D) for shape in saved["compiled"]), saved["compiled"]
    assert sum(s.numel() for s in saved["compiled"]) <= sum(s.numel() for s in saved["eager"])
