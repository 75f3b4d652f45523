"""`python -m bench.attention` (flex kernel configurations) on a CPU: its pure parts and its refusals. The timing
itself runs on CUDA (tests/trainer/gpu/test_flex_options_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from bench.attention import best, candidates, choice, configs_for, main, tflops
from tests.trainer.bench.refusals import assert_needs_a_gpu


def row(attention, config, options, fwd, bwd=None, error=None):
    r = {"attention": attention, "config": config, "options": options, "fwd_ms": fwd}
    if bwd is not None:
        r["bwd_ms"] = bwd
    if error:
        r = {**r, "error": error}
    return r


def test_best_takes_each_kernel_from_the_configurations_that_change_only_it():
    rows = [
        row("drafter", "default", {}, 1.5, 2.5),
        row("drafter", "fast_fwd", {"fwd_BLOCK_M": 64}, 0.8, 2.5),
        # its forward is timed faster by noise only: it did not change the forward kernel
        row("drafter", "fast_bwd", {"bwd_BLOCK_M1": 64}, 0.7, 2.3),
        row("drafter", "broken", {"fwd_BLOCK_M": 32}, 0.1, 0.1, error="OutOfResources"),
        row("target", "default", {}, 0.3),
        row("target", "slow", {"fwd_BLOCK_M": 128}, 0.4),
    ]
    assert best(rows) == {"drafter": {"fwd_ms": ("fast_fwd", 0.8), "bwd_ms": ("fast_bwd", 2.3)},
                          "target": {"fwd_ms": ("default", 0.3)}}


def test_choice_keeps_a_kernel_configuration_only_past_the_margin():
    rows = [
        row("drafter", "default", {}, 1.00, 2.00),
        row("drafter", "f_fast", {"fwd_BLOCK_M": 64}, 0.50, 2.00),
        row("drafter", "b_noise", {"bwd_BLOCK_M1": 32}, 1.00, 1.95),  # 2.5% faster: within the margin
        row("target", "default", {}, 0.30),
        row("target", "f_slight", {"fwd_BLOCK_M": 128}, 0.295),
    ]
    got = choice(rows)
    assert got["drafter"]["options"] == {"fwd_BLOCK_M": 64}
    assert got["drafter"]["bwd_ms"] == ("b_noise", 1.95)  # still reported as the fastest
    assert got["target"]["options"] == {}
    rows[2]["bwd_ms"] = 1.90
    assert choice(rows)["drafter"]["options"] == {"fwd_BLOCK_M": 64, "bwd_BLOCK_M1": 32}
    failed_default = [row("target", "default", {}, 0.3, error="x"), row("target", "f", {"fwd_BLOCK_M": 64}, 0.1)]
    assert choice(failed_default)["target"]["options"] == {}  # nothing to beat: keep torch's default


def test_tflops_counts_two_products_per_pair_forward_and_five_backward():
    # 1e9 pairs x 4 x 64 x 16 = 4.096e12 FLOP in 10 ms
    assert tflops(1e9, 64, 16, 10.0) == pytest.approx(409.6)
    assert tflops(1e9, 64, 16, 10.0, backward=True) == pytest.approx(1024.0)


def test_candidates_touch_one_kernel_each_and_the_target_times_forwards_only():
    every = candidates()
    assert every["default"] == {}
    for name, options in every.items():
        prefixes = {key.split("_", 1)[0] for key in options}
        assert prefixes <= {"fwd", "bwd"} and len(prefixes) <= 1, name
    target = configs_for("target", 64)
    assert "tuned" in target and not any(k.startswith("bwd_") for o in target.values() for k in o)
    drafter = configs_for("drafter", 64)
    assert any(k.startswith("bwd_") for k in drafter["tuned"]) and "b64x64s3w4" in drafter
    assert "tuned" not in configs_for("drafter", 32)  # no choice for that head dim: torch's defaults


@pytest.mark.parametrize("argv, says", [
    (["--shape", "huge"], "unknown --shape"),
    (["--only", "f1x1"], "unknown --only"),
    (["--seq", "100"], "multiples of 128"),
    (["--block", "1"], "--block must be >= 2"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--attention", "both"], "a comma list of drafter, target"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m bench.attention: error: ") and says in last


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a CUDA GPU")
def test_a_machine_without_cuda_is_refused_in_one_line():
    assert_needs_a_gpu(main, ["--shape", "small"])
