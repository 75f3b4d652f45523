"""bench/target.py's refusals and bench/shapes.py's FLOPs of the 2026 families (CPU; the timings need the H200)."""
from __future__ import annotations

import pytest

from bench.shapes import SHAPES, StepCounts, target_config, target_layer_costs


def test_active_parameters_of_the_public_shapes():
    """Counted from the configs: Qwen3-30B-A3B activates 3.3B parameters a token, gpt-oss-20b 3.6B and
    Qwen3.5-35B-A3B 3B (their model cards, embeddings counted once), Qwen3.5-9B is 9B; a dense layer is the Qwen3
    formula."""
    def active(name: str, embeddings: int) -> float:
        cfg = target_config(name, 3072)
        layers = target_layer_costs(cfg, cfg.num_hidden_layers)
        return (sum(layer.params for layer in layers) + embeddings * cfg.vocab_size * cfg.hidden_size) / 1e9

    assert active("qwen3-30b-a3b", 2) == pytest.approx(3.35, abs=0.05)
    assert active("gpt-oss-20b", 1) == pytest.approx(3.6, abs=0.05)
    assert active("qwen3.5-9b", 2) == pytest.approx(8.95, abs=0.05)
    assert active("qwen3.5-35b-a3b", 1) == pytest.approx(2.95, abs=0.05)
    cfg = target_config("qwen3-8b", 3072)
    d, hd, kv, q, i = 4096, 128, 8, 32, 12288
    assert target_layer_costs(cfg, 1)[0].params == d * q * hd + 2 * d * kv * hd + q * hd * d + 3 * d * i


def test_sliding_and_linear_layers_cost_what_they_compute():
    from bench.shapes import FlopShape, Dims, useful_flops

    oss = target_layer_costs(target_config("gpt-oss-20b", 3072), 2)
    assert [layer.window for layer in oss] == [128, None]  # sliding, then full
    hybrid = target_layer_costs(target_config("qwen3.5-9b", 3072), 4)
    assert [layer.heads for layer in hybrid] == [0, 0, 0, 16] and hybrid[0].recurrent > 0
    drafter = Dims(64, 4, 2, 16, 128)
    counts = StepCounts(rows=1, seq=256, anchors=4, block=4, target_pairs={None: 1000.0, 128: 300.0}, draft_pairs=10.0)
    flops = [useful_flops(FlopShape(target_layers=(layer,), target_hidden=2880, drafter=drafter, draft_layers=1,
                                    taps=1, vocab=100), counts)["target"] for layer in oss]
    assert flops[1] - flops[0] == pytest.approx(4 * 64 * 64 * (1000 - 300))  # only the window's pairs differ


def test_an_hf_forward_of_packed_documents_is_refused():
    from bench.target import main

    with pytest.raises(SystemExit):
        main(["--shape", "qwen3.5-9b", "--docs", "3"])


def test_every_shape_builds_its_config():
    for name in SHAPES:
        assert target_config(name, 3072).model_type == SHAPES[name]["model_type"]
