"""optim.name=muon: trainer.step.muon's capturable Muon against torch.optim.Muon, the parameter split, the combined
optimizer's checkpoint round trip, a tiny run that learns and resumes exactly, and the config refusals."""
import io
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.trainer.conftest import small_cfg
from trainer.build import build
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.loop import StopRule, TrainLoop
from trainer.step.muon import CapturableMuon, MuonAdamW, is_muon_param
from trainer.step.step import build_optimizer


def run_muon(opt_cls, lr, lrs, init, grads, **kw):
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = opt_cls(params, lr=lr, **kw)
    for k, gs in enumerate(grads):
        if isinstance(lr, torch.Tensor):
            lr.fill_(lrs[k])  # in place, as the schedule does
        else:
            for g in opt.param_groups:
                g["lr"] = lrs[k]
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("nesterov, adjust", [(True, "original"), (False, "match_rms_adamw")])
def test_capturable_muon_with_a_tensor_lr_updates_as_torch_muon_with_a_float_one(nesterov, adjust):
    """The interop check: torch's own Muon (float LR) and ours (device-tensor LR) over a few steps, tall, wide and
    square matrices, weight decay on."""
    torch.manual_seed(0)
    init = [torch.randn(12, 5), torch.randn(5, 9), torch.randn(6, 6)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(4)]
    lrs = [0.02, 0.015, 0.01, 0.005]
    common = dict(weight_decay=0.1, momentum=0.95, nesterov=nesterov, ns_steps=5)
    ref = run_muon(torch.optim.Muon, lrs[0], lrs, init, grads, adjust_lr_fn=adjust, **common)
    ours = run_muon(CapturableMuon, torch.tensor(lrs[0]), lrs, init, grads, adjust_lr=adjust, capturable=False,
                    **common)
    for a, b, t in zip(ref, ours, init):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
        assert not torch.equal(a, t)  # it did train


def test_the_split_sends_matrices_to_muon_and_norms_vectors_and_codebooks_to_adamw():
    p = torch.nn.Parameter
    assert is_muon_param("layers.0.self_attn.q_proj.weight", p(torch.zeros(8, 4)))
    assert is_muon_param("fc.weight", p(torch.zeros(4, 12)))  # the tap projection: a matrix like the others
    assert not is_muon_param("layers.0.input_layernorm.weight", p(torch.zeros(8)))
    assert not is_muon_param("q_proj.bias", p(torch.zeros(8)))
    assert not is_muon_param("degenerate.weight", p(torch.zeros(1, 8)))
    assert not is_muon_param("candidate_selector.predecessor_codebook", p(torch.zeros(50, 4)))
    assert not is_muon_param("frozen.weight", p(torch.zeros(8, 4), requires_grad=False))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)  # weight -> Muon, bias -> AdamW
        self.norm = torch.nn.Parameter(torch.ones(4))


def test_muon_adamw_is_one_optimizer_to_the_step_and_checkpoint_code():
    torch.manual_seed(0)
    model = Tiny()
    opt, lr_ = build_optimizer(model, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                               device=torch.device("cpu"), name="muon")
    assert isinstance(opt, MuonAdamW)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 2]
    assert all(g["lr"] is lr_ for g in opt.param_groups)  # one tensor the schedule fills drives both
    assert opt.muon.param_groups[0]["params"][0] is model.fc.weight

    def step():
        opt.zero_grad(set_to_none=True)
        (model.fc.weight.sum() ** 2 + (model.fc.bias * model.norm).sum()).backward()
        opt.step()

    step()
    assert set(map(id, opt.state)) == {id(p) for p in model.parameters()}
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # as trainer.checkpoint writes it (the state dict itself aliases the state)
    buf.seek(0)
    saved = torch.load(buf)
    twin = Tiny()
    twin.load_state_dict(model.state_dict())
    topt, tlr = build_optimizer(twin, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                device=torch.device("cpu"), name="muon")
    topt.load_state_dict(saved)
    step()
    topt.zero_grad(set_to_none=True)
    (twin.fc.weight.sum() ** 2 + (twin.fc.bias * twin.norm).sum()).backward()
    topt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(KeyError):  # an AdamW run's optimizer state is not a Muon run's
        topt.load_state_dict(torch.optim.AdamW(Tiny().parameters()).state_dict())


class HostReads(TorchDispatchMode):
    """Counts aten._local_scalar_dense: what .item() / float(tensor) / a tensor passed as a Scalar dispatch to, the
    host read that syncs with a CUDA device and that a CUDA graph capture refuses."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_the_muon_adamw_step_reads_nothing_on_the_host_where_torch_muon_reads_its_lr():
    """The CPU proxy for capturability: torch.optim.Muon with a tensor LR reads it on the host (the reason for
    trainer.step.muon); the combined step reads nothing."""
    torch.manual_seed(0)
    model = Tiny()
    opt, _ = build_optimizer(model, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                             device=torch.device("cpu"), name="muon")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with HostReads() as reads:
        opt.muon.step()
    assert reads.count == 0
    ref = torch.optim.Muon([torch.nn.Parameter(model.fc.weight.detach().clone())], lr=torch.tensor(1e-2))
    ref.param_groups[0]["params"][0].grad = model.fc.weight.grad.clone()
    with HostReads() as reads:
        ref.step()
    assert reads.count >= 1


def test_the_muon_step_compiles_to_one_graph():
    """No graph break in the Muon step under torch.compile(fullgraph=True)."""
    torch.manual_seed(0)
    model = Tiny()
    opt, lr_ = build_optimizer(model, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                               device=torch.device("cpu"), name="muon")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.muon.step()  # state exists before the traced step, as after the graph's warm-up
    torch._dynamo.reset()
    torch.compile(opt.muon.step, fullgraph=True, backend="eager")()


def test_the_adamw_default_is_a_plain_adamw():
    opt, _ = build_optimizer(Tiny(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                             device=torch.device("cpu"))
    assert type(opt) is torch.optim.AdamW and load_config("smoke").optim.name == "adamw"


@pytest.mark.parametrize("item, needle", [
    ("optim.name=sgd", "optim.name must be 'adamw' or 'muon', got 'sgd'"),
    ("optim.muon_momentum=1", "optim.muon_momentum must be in [0, 1)"),
    ("optim.muon_ns_steps=0", "optim.muon_ns_steps must be in [1, 99], got 0"),
    ("optim.muon_weight_decay=nan", "optim.muon_weight_decay must be a finite number >= 0, got nan"),
    ("optim.muon_adjust_lr=moonshot", "optim.muon_adjust_lr must be 'original' or 'match_rms_adamw'"),
])
def test_bad_muon_settings_are_config_errors(item, needle):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", ["optim.name=muon", item])
    assert needle in str(e.value)


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_a_muon_run_learns_and_its_resume_equals_the_uninterrupted_run(tmp_path, tiny_target_dir):
    sets = ("optim.name=muon", "optim.max_steps=16", "ckpt.every=8", "log.every=1", "optim.lr=3e-3",
            "optim.warmup_ratio=0.05", "data.rows_per_step=2")
    full = build(small_cfg(tiny_target_dir, *sets), tmp_path / "full")
    assert isinstance(full.state.optimizer, MuonAdamW)
    TrainLoop(full).run()
    a = losses(tmp_path / "full")
    assert sum(a[s] for s in (13, 14, 15, 16)) < 0.8 * sum(a[s] for s in (1, 2, 3, 4)), a
    first = build(small_cfg(tiny_target_dir, *sets), tmp_path / "split")
    TrainLoop(first).run(StopRule(steps=10))  # stopped after step 10: resumes from the step-8 checkpoint
    del first
    torch.manual_seed(12345)
    second = build(small_cfg(tiny_target_dir, *sets), tmp_path / "split", resume=True)
    assert second.start.step == 8
    TrainLoop(second).run()
    b = losses(tmp_path / "split")
    assert [b[s] for s in range(1, 17)] == [a[s] for s in range(1, 17)]  # bit-exact on CPU
    pa = dict(full.state.drafter.named_parameters())
    for name, p in second.state.drafter.named_parameters():
        assert torch.equal(p, pa[name]), name
