"""When decoding is lossless (trainer/decode/lossless.py): each condition, the probes that read what ran, and the
verdict `trainer eval --prompts` prints."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.decode.lossless import Numerics, describe, gemm_rows_identical, norm_path, rows_identical, unmet, verdict

MET = Numerics(engine="static", dtype="bfloat16", norms="invariant", attention="invariant", target_compiled=False,
               gemm_rows_identical=True)


def test_all_conditions_met_is_lossless_by_construction():
    v = verdict(MET, [True, True, True])
    assert v["guaranteed"] and v["unmet"] == [] and (v["identical"], v["prompts"], v["differing"]) == (3, 3, [])
    assert describe(v).startswith("lossless by construction (bfloat16, static engine")
    assert describe(v).endswith("; 3/3 outputs equal the target's")


@pytest.mark.parametrize("change, phrase", [
    (dict(engine="hf"), "engine hf"),
    (dict(norms="hf"), "RMSNorm: the HF module"),
    (dict(attention="sdpa"), "attention sdpa"),
    (dict(target_compiled=True), "compiled"),
    (dict(gemm_rows_identical=False), "bfloat16 GEMMs round a row differently"),
])
def test_each_unmet_condition_is_named(change, phrase):
    n = dataclasses.replace(MET, **change)
    assert len(unmet(n)) == 1 and phrase in unmet(n)[0]
    v = verdict(n, [True, False, True])
    assert not v["guaranteed"] and v["differing"] == [1]
    assert describe(v).startswith("not lossless by construction (") and "(differing: prompts 1)" in describe(v)


def test_the_row_probe_sees_a_row_that_depends_on_the_others():
    x = torch.randn(16, 8)
    assert rows_identical(lambda t: 2 * t + 1, x)
    assert not rows_identical(lambda t: t - t.mean(dim=0), x)


def test_the_gemm_probe_on_a_linear_without_sums():
    # in_features 1: one product per output and no sum to reorder, whatever the kernel
    assert gemm_rows_identical(torch.nn.Sequential(torch.nn.Linear(1, 64, bias=False)), rows=16)


def test_the_norm_probe_reads_what_the_static_target_runs(interpreter, full_target):
    from trainer import triton_device
    from trainer.decode.stack import StaticTarget

    static = StaticTarget(full_target, 32)
    assert norm_path(static) == "invariant"  # every RMSNorm of the model wrapped, the kernel usable here
    static.final_norm = static.final_norm.module  # one norm left to the HF module
    assert norm_path(static) == "hf"
    triton_device.CPU_UNDER_INTERPRETER = False  # restored by the fixture
    assert norm_path(StaticTarget(full_target, 32)) == "hf"  # CPU without the interpreter: the HF modules run


def test_lossless_facts_of_a_cpu_decode(full_target):
    """A real decode on CPU in fp32: HF norms and SDPA ran, so the verdict says not guaranteed, naming both."""
    from tests.trainer.decode.test_reference import _drafter
    from trainer.quality.config import EvalCfg
    from trainer.quality.evaluate import decode_benchmark

    cfg = EvalCfg(prompts=2, max_new_tokens=6, warmup=0, budget_s=float("inf"), target_dtype="float32")
    r = decode_benchmark(full_target, _drafter(full_target), 4, ["def f(x):", "class A:"], cfg, log=lambda m: None)
    v = r["lossless"]
    assert r["norms"] == "hf" and v["attention"] == "sdpa" and v["dtype"] == "float32" and not v["guaranteed"]
    assert any("RMSNorm" in u for u in v["unmet"]) and any("attention sdpa" in u for u in v["unmet"])
    assert v["identical"] == r["identical"] and v["prompts"] == r["prompts"] == 2
    assert isinstance(v["gemm_rows_identical"], bool)
