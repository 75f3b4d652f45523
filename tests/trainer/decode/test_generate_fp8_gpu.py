"""The FP8 target at batched generation on the H200 (`python3 -m pytest -m gpu tests/trainer/decode`): the target's
decoder linears quantized in place (`quantize_target_layers`: `Fp8Linear` on `torch._scaled_mm`, the gated MLP's
SwiGLU quantized by its Triton kernel) are captured in the static engine's CUDA graphs, whose replay gives exactly
what the same engine computes eagerly, greedy and sampled; outside torch.compile an input's rows are quantized by one
Triton kernel with the torch form's bits, once for attention's q, k and v; `bench.generate --target-fp8 1` and
`regenerate --target-fp8` run it and record it."""
from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.decode.test_generate import REFILL_LENGTHS, prompts_of, stops_inside
from trainer.decode.generate import BatchGenerator, Sampling
from trainer.model.fp8 import Fp8Linear, fp8_refusal, project_shared
from trainer.model.fp8_rows import quantize_rows, quantize_rows_torch
from trainer.model.fp8_target import Fp8GatedMlp, quantize_target_layers
from trainer.model.target import load_target

pytestmark = pytest.mark.gpu


def fp8_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs CUDA")
    device = torch.device("cuda")
    why = fp8_refusal(device, "the FP8 target")
    if why:
        pytest.fail(why)
    return device


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M, K", [(256, 4096), (65536, 4096), (300, 14336), (5, 30000), (7, 100)])
def test_the_row_kernel_gives_the_torch_forms_bits_on_cuda(dtype, M, K):
    """The eager CUDA path (the kernel) against the torch form on the same GPU: every e4m3 byte and scale, rows of
    one block and looped ones, zeros, huge values; a NaN turns its whole row NaN, as in torch."""
    device = fp8_device()
    torch.manual_seed(K)
    x = torch.randn(M, K, device=device) * 3
    x[1] = 0
    x[2] *= 1e30 if dtype == torch.float32 else 1e3
    x[3, K // 3] = float("nan")
    x = x.to(dtype)
    q, scale = quantize_rows(x)
    want_q, want_scale = quantize_rows_torch(x)
    finite = torch.ones(M, dtype=torch.bool, device=device)
    finite[3] = False
    assert torch.equal(scale[finite], want_scale[finite])
    assert torch.equal(q[finite].view(torch.uint8), want_q[finite].view(torch.uint8))
    assert torch.isnan(q[3].float()).all() and torch.isnan(want_q[3].float()).all() and torch.isnan(scale[3]).all()


def test_an_fp8_linear_launches_one_quantization_kernel_and_qkv_share_one():
    """Outside compile: one Triton kernel quantizes a linear's input (the torch form launched nine), and q, k and v
    read one quantization (`project_shared`), with the same outputs as each linear alone."""
    from torch.profiler import ProfilerActivity, profile

    device = fp8_device()
    torch.manual_seed(0)
    lins = [Fp8Linear(torch.nn.Linear(4096, n, bias=False, device=device, dtype=torch.bfloat16))
            for n in (4096, 1024, 1024)]
    x = torch.randn(256, 1, 4096, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        alone = [lin(x) for lin in lins]  # also compiles the kernel before the count
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            shared = project_shared(x, lins)
            torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(shared, alone))
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("quantize_e4m3_rows" in n for n in names) == 1, names
    assert len(names) <= 1 + 2 * len(lins), names  # one quantization, then each GEMM (at most one helper kernel)


def test_joined_fp8_qkv_is_one_quantization_and_one_gemm():
    """The batch generator's FP8 q/k/v (decode/fused.py `JoinedFp8`, qwen3-8b's widths): one quantization kernel and
    one e4m3 GEMM, each output within the FP8 GEMM's rounding of its linear alone."""
    from torch.profiler import ProfilerActivity, profile

    from trainer.decode.fused import JoinedFp8

    device = fp8_device()
    torch.manual_seed(0)
    lins = [Fp8Linear(torch.nn.Linear(4096, n, bias=False, device=device, dtype=torch.bfloat16))
            for n in (4096, 1024, 1024)]
    x = torch.randn(256, 1, 4096, device=device, dtype=torch.bfloat16)
    joined = JoinedFp8(lins)
    with torch.no_grad():
        alone = [lin(x) for lin in lins]
        joined(x)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = joined(x)
            torch.cuda.synchronize()
    for g, a in zip(got, alone):
        torch.testing.assert_close(g.float(), a.float(), rtol=1e-2, atol=1e-2)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("quantize_e4m3_rows" in n for n in names) == 1 and len(names) <= 3, names


def test_fp8_graph_replay_equals_the_eager_engine(family_dirs):
    device = fp8_device()
    target = load_target(family_dirs["qwen3"], num_draft_layers=2, layer_ids=(1, 3), device=device,
                         dtype="bfloat16", truncate=False)
    assert quantize_target_layers(target.model.model.layers) == 7 * len(target.model.model.layers)
    mlps = [layer.mlp for layer in target.model.model.layers]
    assert all(isinstance(m, Fp8GatedMlp) and m.kernel for m in mlps)  # the Triton SwiGLU kernel, in the graphs
    prompts = prompts_of(target, REFILL_LENGTHS + (90,), seed=3)  # 90: the steps change span
    stops = stops_inside(target, prompts, 40)
    for sampling in (Sampling(max_new_tokens=40), Sampling(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=11)):
        replayed = BatchGenerator(target, rows=3, max_len=160, stop_ids=stops)
        got = replayed.generate(prompts, sampling)
        assert replayed.refilled >= 6 and replayed.programs
        assert all(p.graph is not None for p in replayed.programs.values())
        eager = BatchGenerator(target, rows=3, max_len=160, stop_ids=stops, graphs=False)
        assert eager.generate(prompts, sampling) == got, sampling


def test_the_bench_runs_and_records_the_fp8_target(capsys):
    from bench import generate as bench

    fp8_device()
    assert bench.main(["--shape", "tiny", "--batch", "4", "--prompt-tokens", "16", "--new-tokens", "8",
                       "--repeats", "1", "--target-fp8", "1"]) == 0
    lines = [json.loads(x.split(" ", 1)[1]) for x in capsys.readouterr().out.splitlines()
             if x.startswith("GENERATE_BENCH ")]
    assert [r["engine"] for r in lines] == ["static", "hf"]
    assert all(r["target_fp8"] is True and r["fp8_linears"] > 0 and r["dtype"] == "bfloat16" for r in lines)
    assert all(r["generated_tokens"] == 4 * 8 for r in lines)


def test_regenerate_runs_the_fp8_target_and_records_it(tiny_target_dir, tmp_path, capsys):
    from tests.trainer.test_regenerate import SMOKE, records, regenerate
    from trainer.regen.outfile import meta_path

    fp8_device()
    out = tmp_path / "out.jsonl"
    code, lines, err = regenerate(capsys, "--target", str(tiny_target_dir), "--prompts", str(SMOKE), "--out",
                                  str(out), "--limit", "4", "--max-new", "16", "--target-fp8", engine="static")
    assert code == 0, err
    assert any("the target's decoder linears to FP8" in ln and "linears; routed experts" in ln for ln in lines)
    meta = json.loads(meta_path(out).read_text())
    assert meta["settings"]["target_fp8"] is True and meta["settings"]["dtype"] == "auto"
    assert meta["engines"] == ["static"] and meta["state"] == "done" and len(records(out)) == 4
