"""`python -m bench.decode` on CPU: the figures it prints are consistent with each other (not timed here)."""
from __future__ import annotations

import json

import pytest
import torch

from bench import decode as bench


def test_bench_prints_consistent_figures_per_engine(capsys, full_target):
    assert bench.main(["--engines", "static,hf", "--new-tokens", "8", "--repeats", "1", "--prompt-tokens", "8",
                       "--device", "cpu", "--block", "4"]) == 0
    lines = [json.loads(l.split(" ", 1)[1]) for l in capsys.readouterr().out.splitlines()
             if l.startswith("DECODE_BENCH ")]
    assert [r["engine"] for r in lines] == ["static", "hf"]
    for r in lines:
        assert r["block_size"] == 4 and r["fixed_ms"]["target_only"] > 0
        # the figures are differences of two decode lengths: on a loaded machine noise can swamp them, and then the
        # record says so instead of giving ratios of noise
        assert r["noisy"] == (r["step_ms"] <= 0 or r["round_ms"] <= 0)
        if r["noisy"]:
            assert r["round_over_step"] is None and r["speedup_at_tau"] is None
        else:
            assert r["round_over_step"] == pytest.approx(r["round_ms"] / r["step_ms"], rel=0.01)
            assert r["speedup_at_tau"]["4"] == pytest.approx(4 / r["round_over_step"], abs=0.02)


def test_bench_refuses_bad_arguments(capsys):
    assert bench.main(["--engines", "static,turbo"]) == 2
    assert "unknown engine" in capsys.readouterr().err
    assert bench.main(["--target", "/nonexistent"]) == 2
    assert bench.main(["--new-tokens", "4"]) == 2
    assert bench.main(["--target", "/nonexistent", "--drafter", "/nonexistent"]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert bench.main(["--layers", "3"]) == 2
    assert "--layers must be >= 4" in capsys.readouterr().err


def test_random_pair_has_the_requested_depth_and_dflash_taps():
    """The bench's default is quality_gpu's 16-layer target, tapped where DFlash's rule puts 3 taps."""
    target, drafter, block = bench.random_pair(torch.device("cpu"), 16, num_layers=16)
    assert len(target.model.model.layers) == 16 and target.num_layers == 16
    assert tuple(target.layer_ids) == (1, 7, 13)
    assert block == 16


def test_every_piece_of_a_round_runs_eagerly(full_target):
    """The pieces the GPU breakdown times, run eagerly on CPU: each is callable and leaves the start where it was."""
    torch.manual_seed(0)
    from tests.trainer.decode.test_reference import _drafter

    pieces = bench._pieces(full_target, _drafter(full_target), 4, graphs=False)
    assert set(pieces) == {"step", "verify", "draft", "append"}
    for fn, rewind in pieces.values():
        rewind()
        fn()
