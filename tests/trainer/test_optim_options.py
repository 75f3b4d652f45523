"""The optimizer the trainer builds: fused + capturable AdamW on CUDA, the per-parameter loop on CPU."""
import torch

from trainer.step.step import adamw_options, build_optimizer


def test_cuda_gets_the_fused_capturable_kernel_and_cpu_the_loop():
    assert adamw_options(torch.device("cuda", 0)) == {"foreach": False, "fused": True, "capturable": True}
    assert adamw_options(torch.device("cpu")) == {"foreach": False, "fused": False, "capturable": False}


def test_fused_capturable_adamw_with_a_tensor_lr_updates_like_the_loop():
    """The CUDA flag set, run here by torch's CPU fused kernel: same update as the loop (fp32 rounding), with the LR
    read from the tensor the schedule fills in place."""
    torch.manual_seed(0)
    init = [torch.randn(7, 5), torch.randn(5)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(3)]
    results = []
    for opts in (adamw_options(torch.device("cpu")), {"foreach": False, "fused": True, "capturable": True}):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        lr_ = torch.tensor(1e-2)
        opt = torch.optim.AdamW(params, lr=lr_, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **opts)
        for k, gs in enumerate(grads):
            lr_.fill_(1e-2 * (k + 1))  # in place, as the training loop's schedule does
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert not torch.equal(results[0][0], init[0])  # it did train


def test_build_optimizer_on_cpu_holds_the_lr_tensor():
    drafter = torch.nn.Linear(3, 2)
    opt, lr_ = build_optimizer(drafter, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                               device=torch.device("cpu"))
    assert all(g["lr"] is lr_ and not g["fused"] and not g["capturable"] for g in opt.param_groups)
