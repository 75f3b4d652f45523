"""StepGraph (the captured whole training step) against the eager step, over the trainer's own step functions, on a
real GPU. Run: pytest -m gpu tests/trainer/gpu."""
import pytest
import torch

from tests.trainer.gpu.gpu_bed import DEV, fresh, max_diff, params
from trainer.step.graph import StepGraph
from trainer.step.policy import compile_step
from trainer.step.stepper import EagerStep, slot_step
from trainer.step.slots import encode

pytestmark = pytest.mark.gpu

K = 6  # training steps compared


def step_inputs(batches, accum: int) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(DEV) for k, v in encode([batches.batch(s * accum + i) for i in range(accum)]).items()}
            for s in range(K)]


def run(target_dir, *, graph: bool, accum: int = 1, compile: bool = False, halve_grads: bool = False):
    _cfg, state, batches = fresh(target_dir)
    if compile:
        compile_step(state)
    sync = None
    if halve_grads:  # stands in for a data-parallel all-reduce between the two captured graphs
        sync = lambda: torch._foreach_mul_([p.grad for p in params(state)], 0.5)  # noqa: E731
    fwd_bwd, opt_step = slot_step(state, accum)
    data = step_inputs(batches, accum)
    if graph:
        stepper = StepGraph(fwd_bwd, opt_step, params(state), state.optimizer, data[0], sync_grads=sync)
        stepper.capture(restore=True)
    else:
        stepper = EagerStep(fwd_bwd, opt_step, state.optimizer, sync_grads=sync)
    losses = []
    for k, inputs in enumerate(data):
        stepper.set_lr(6e-4 * (k + 1) / K)  # LR changes in place between replays
        out = stepper.step(inputs)
        losses.append(out["0.loss_"].clone())  # graph outputs are overwritten by the next replay
    torch.cuda.synchronize()
    return [p.detach().clone() for p in params(state)], torch.stack(losses)


def test_graph_matches_eager_bit_for_bit(tiny_target_dir):
    """Tolerance 0: flex is deterministic, so eager equals eager, and any graph difference would be a capture bug."""
    p_e1, l_e1 = run(tiny_target_dir, graph=False, accum=2)
    p_e2, _ = run(tiny_target_dir, graph=False, accum=2)
    p_g, l_g = run(tiny_target_dir, graph=True, accum=2)
    assert max_diff(p_e1, p_e2) == 0.0
    assert max_diff(p_e1, p_g) == 0.0
    assert torch.equal(l_e1, l_g)
    assert len(set(l_g.tolist())) == K  # replays saw K different batches
    assert max_diff(p_e1, [p.detach() for p in params(fresh(tiny_target_dir)[1])]) > 0  # training moved them


def test_split_graph_with_grad_sync_matches_eager(tiny_target_dir):
    p_e, l_e = run(tiny_target_dir, graph=False, halve_grads=True)
    p_g, l_g = run(tiny_target_dir, graph=True, halve_grads=True)
    p_full, _ = run(tiny_target_dir, graph=True, halve_grads=False)
    assert max_diff(p_e, p_g) == 0.0
    assert torch.equal(l_e, l_g)
    assert max_diff(p_g, p_full) > 0  # the eager callback between the graphs really ran on every replay


def test_compiled_graph_matches_compiled_eager(tiny_target_dir):
    p_e, l_e = run(tiny_target_dir, graph=False, compile=True)
    p_g, l_g = run(tiny_target_dir, graph=True, compile=True)
    assert max_diff(p_e, p_g) == 0.0
    assert torch.equal(l_e, l_g)


def test_step_rejects_wrong_shapes(tiny_target_dir):
    _cfg, state, batches = fresh(tiny_target_dir)
    fwd_bwd, opt_step = slot_step(state, 1)
    inputs = {k: v.to(DEV) for k, v in encode([batches.batch(0)]).items()}
    sg = StepGraph(fwd_bwd, opt_step, params(state), state.optimizer, inputs, warmup_steps=1)
    sg.capture()
    with pytest.raises(ValueError, match="0.anchor_pos"):
        sg.step(dict(inputs, **{"0.anchor_pos": inputs["0.anchor_pos"][:, :8]}))
    with pytest.raises(ValueError, match="0.input_ids"):
        sg.step(dict(inputs, **{"0.input_ids": inputs["0.input_ids"].int()}))
