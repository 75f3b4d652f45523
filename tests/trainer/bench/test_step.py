"""`python -m bench.step` on the CPU: the trainer's own path (real tiny HF target, real runners), its refusals,
and the synthetic StaticBatch it feeds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.synthetic import draft_pairs, synthetic_batches, target_pairs
from trainer.data.anchors import anchor_candidates
from trainer.data.batching import StaticBatch
from trainer.model.attention import dense_block_mask, make_layout
from trainer.model.flex import BlockLayoutShape
from trainer.model.target import packed_causal_mask

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY = ["--shape", "tiny", "--batch", "2", "--seq", "256", "--anchors", "16", "--steps", "3", "--warmup", "1",
        "--interval", "2"]


def bench(*args: str, cuda: bool = False) -> subprocess.CompletedProcess:
    """Run to exit (the session's pytest timeout guards hangs); on the CPU unless `cuda`."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **({} if cuda else {"CUDA_VISIBLE_DEVICES": ""}))
    return subprocess.run([sys.executable, "-m", "bench.step", *args], cwd=REPO_ROOT, env=env, text=True,
                          capture_output=True)


def results(out: str) -> dict[str, dict]:
    found = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    return {r["mode"]: r for r in found}


def table_row(out: str, mode: str) -> list[str]:
    header = next(i for i, line in enumerate(out.splitlines()) if line.startswith("mode "))
    return next(line.split() for line in out.splitlines()[header + 1:] if line.split()[0] == mode)


@pytest.fixture(scope="module")
def eager_and_compiled() -> subprocess.CompletedProcess:
    """One default (DFlash drafter, AdamW) tiny bench of eager and compile, read by the tests below that need such a
    run; each of them asserts its exit status, so a failed run fails each of them."""
    return bench(*TINY, "--modes", "eager,compile")


@pytest.mark.slow
def test_cpu_bench_runs_the_trainer_eager_and_compiled_and_prints_the_table(eager_and_compiled):
    proc = eager_and_compiled
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = results(proc.stdout)
    for mode in ("eager", "compile"):
        r = res[mode]
        assert r["device"] == "cpu" and r["attn"] == "sdpa" and r["target_attn"] == "sdpa"
        assert r["tokens_per_step"] == 2 * 256 and r["tokens_per_s_per_gpu"] > 0
        assert r["tokens_per_s_per_gpu"] == pytest.approx(512 / r["step_s_median"])
        assert all(v == v and abs(v) < 20 for v in r["loss_first_last"])  # finite CE over a 1024-token vocabulary
        assert float(table_row(proc.stdout, mode)[1]) == pytest.approx(r["tokens_per_s_per_gpu"], abs=1)
        assert f"MEM {mode} " in proc.stdout
    # The two modes trained the same model from the same seed on the same data: same first loss.
    assert res["compile"]["loss_first_last"][0] == pytest.approx(res["eager"]["loss_first_last"][0], rel=1e-3)
    # LM-head FLOPs from the HF config: rows * anchors * (block - 1) positions, forward + input grad.
    assert res["eager"]["flops"]["lm_head"] == 2 * (2 * 2 * 16 * 15 * 128 * 1024)
    assert res["eager"]["head_fp8"] is False and res["compile"]["head_fp8"] is False  # auto: no FP8 cores on a CPU


@pytest.mark.slow
def test_drafter_and_optim_reach_the_built_step_and_the_headline_names_them(eager_and_compiled):
    """--drafter dflash2 --optim muon: one tiny eager step, against the module's default run (dflash, adamw; its
    eager mode), the kinds read off the built state (a DFlash2 drafter has more parameters than a DFlash one of the
    same dims: its convolutions and selector)."""
    one = [*TINY, "--steps", "1", "--warmup", "0", "--modes", "eager"]
    runs = {}
    for drafter, optim in (("dflash", "adamw"), ("dflash2", "muon")):
        # the defaults are dflash and adamw: the module's run built them
        proc = eager_and_compiled if drafter == "dflash" else bench(*one, "--drafter", drafter, "--optim", optim)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        r = runs[drafter] = results(proc.stdout)["eager"]
        assert (r["drafter"], r["optim"]) == (drafter, optim)
        assert f"drafter {drafter}, optim {optim}, shape tiny, 1 x 2 rows x 256 tokens per step" in proc.stdout
        assert all(v == v and abs(v) < 40 for v in r["loss_first_last"])
    assert runs["dflash2"]["drafter_params"] > runs["dflash"]["drafter_params"]
    assert runs["dflash2"]["flops"] == runs["dflash"]["flops"]  # the same useful FLOPs: compare by tokens/s


@pytest.mark.gpu
@pytest.mark.parametrize("drafter, optim", [("dflash2", "adamw"), ("dflash", "muon")])
def test_the_dflash2_and_muon_steps_run_captured_on_the_gpu(drafter, optim):
    """What docs/benchmarks.md ("DFlash2 against DFlash, Muon against AdamW") measures, at the tiny shape: each
    captured mode builds the named drafter and optimizer and trains with finite losses."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    proc = bench(*TINY, "--modes", "graph,compile+graph", "--drafter", drafter, "--optim", optim, cuda=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for mode, r in results(proc.stdout).items():
        assert (r["drafter"], r["optim"], r["attn"]) == (drafter, optim, "flex"), mode
        assert all(v == v and abs(v) < 40 for v in r["loss_first_last"]) and r["tokens_per_s_per_gpu"] > 0, mode
    assert f"drafter {drafter}, optim {optim}, shape tiny" in proc.stdout


def test_the_headline_names_the_flags_when_no_mode_finished():
    from bench.step import headline, parse

    cfg = parse(["--shape", "tiny", "--drafter", "dflash2", "--optim", "muon"])[0]
    assert headline(cfg, [{"mode": "graph", "error": "x"}]) == \
        "drafter dflash2, optim muon, shape tiny, 1 x 4 rows x 3072 tokens per step"


def test_graph_modes_and_pipeline_refuse_clearly_on_cpu():
    proc = bench(*TINY, "--modes", "graph,compile+graph")
    assert proc.returncode == 1
    refusal = "FAILED: step.mode=graph needs a CUDA device (this run is on cpu)"
    assert table_row(proc.stdout, "graph")[1:] == refusal.split()
    assert "FAILED: step.mode=compile+graph needs a CUDA device" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    piped = bench(*TINY, "--pipeline", "1", "--modes", "eager")
    assert piped.returncode == 1 and "FAILED: pipeline.enabled needs a CUDA device" in piped.stdout


@pytest.mark.slow
def test_target_dir_loads_through_load_target(tiny_target_dir):
    from transformers import AutoConfig

    proc = bench(*TINY, "--steps", "1", "--warmup", "0", "--target", str(tiny_target_dir), "--draft-layers", "2",
                 "--modes", "eager")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = results(proc.stdout)["eager"]
    assert r["shape"] == str(tiny_target_dir)
    hf = AutoConfig.from_pretrained(tiny_target_dir)
    assert r["flops"]["lm_head"] == 2 * (2 * 2 * 16 * 15 * hf.hidden_size * hf.vocab_size)


@pytest.mark.parametrize("args, message", [
    (["--shape", "huge"], "unknown --shape 'huge'"),
    (["--target", "/nonexistent"], "--target /nonexistent: no config.json there"),
    (["--modes", "fast"], "unknown mode(s) ['fast']"),
    (["--attn", "other"], "unknown --attn 'other'"),
    (["--shape", "small"], "--shape small is a GPU shape and this machine has no CUDA GPU; on a CPU use --shape tiny"),
    (["--shape", "tiny", "--inductor", "no_such=1"], "--inductor: torch._inductor.config has no 'no_such'"),
    (["--shape", "tiny", "--inductor", "max_autotune"], "--inductor 'max_autotune': expected KEY=VALUE"),
    (["--shape", "tiny", "--inductor", "coordinate_descent_tuning=false"],
     "--inductor coordinate_descent_tuning='false': expected a bool like its default False"),
    ([], "--shape small is a GPU shape and this machine has no CUDA GPU"),  # the default shape
    (["--shape", "tiny", "--drafter", "eagle3"], "unknown --drafter 'eagle3'; choose one of ['dflash', 'dflash2']"),
    (["--shape", "tiny", "--optim", "sgd"], "unknown --optim 'sgd'; choose one of ['adamw', 'muon']"),
])
def test_bad_arguments_are_one_line_and_nonzero(args, message):
    proc = bench(*args)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [message + proc.stderr.strip().split(message, 1)[1]]


def test_a_dflash2_drafter_that_does_not_fit_the_target_is_refused_before_the_build(tmp_path):
    """The trainer's check of DFlash2's default groups (16 channels) against --target's width, in the parent."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 72, "vocab_size": 512,
                                                      "num_hidden_layers": 4}))
    proc = bench("--target", str(tmp_path), "--drafter", "dflash2")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["--drafter dflash2: model.dflash2.conv_group_size=16 does not divide the "
                                        "drafter's width (the target's hidden size 72)"]


def test_inductor_settings_are_parsed_and_reach_the_nested_configs(monkeypatch):
    import torch._inductor.config as inductor_config

    from bench.step import inductor_settings, set_inductor

    settings = inductor_settings("triton.multi_kernel=1, coordinate_descent_tuning=True,, cpp.simdlen=None")
    assert settings == {"triton.multi_kernel": 1, "coordinate_descent_tuning": True, "cpp.simdlen": None}
    assert inductor_settings("fx_graph_cache=False,realize_opcount_threshold=30") == {
        "fx_graph_cache": False, "realize_opcount_threshold": 30}
    # a comma inside a value (a real setting's list form), a literal ast refuses, '=' in a value
    assert inductor_settings("max_autotune_gemm_backends=ATEN,TRITON,triton.multi_kernel=1") == {
        "max_autotune_gemm_backends": "ATEN,TRITON", "triton.multi_kernel": 1}
    assert inductor_settings("a={[]: 1},b=x=y") == {"a": "{[]: 1}", "b": "x=y"}
    # restored after the test
    monkeypatch.setattr(inductor_config.triton, "multi_kernel", inductor_config.triton.multi_kernel)
    monkeypatch.setattr(inductor_config, "coordinate_descent_tuning", inductor_config.coordinate_descent_tuning)
    set_inductor({"triton.multi_kernel": 1, "coordinate_descent_tuning": True})
    assert inductor_config.triton.multi_kernel == 1 and inductor_config.coordinate_descent_tuning is True


def test_synthetic_batch_has_the_bench_shape_and_passes_the_trainers_checks():
    rows, seq, anchors, block = 4, 3072, 512, 16
    batches = synthetic_batches(2, rows, seq, anchors, 151936, seed=0)
    assert len(batches) == 2 and not torch.equal(batches[0].input_ids, batches[1].input_ids)
    for b in batches:
        assert b.signature() == StaticBatch.empty(rows, seq, anchors).signature()  # exact fixed shapes and dtypes
        StaticBatch.empty(rows, seq, anchors).copy_(b)  # the runners' static-buffer copy accepts it
        BlockLayoutShape(rows, seq, anchors, block)  # the flex layout's tile constraints hold
        assert b.anchor_valid.all() and (b.anchor_pos.diff(dim=1) > 0).all()  # all valid, sorted, distinct
        assert anchor_candidates(b.loss_mask, b.doc_ids).gather(1, b.anchor_pos).all()
        assert (b.doc_ids >= 0).all() and b.loss_mask.all()  # rows filled exactly, every token supervised
        for r in range(rows):
            starts = (b.position_ids[r] == 0).nonzero().flatten()
            assert starts.tolist()[0] == 0 and len(starts) == 3  # three packed documents per row
            assert b.doc_ids[r].unique().tolist() == [0, 1, 2] and (b.doc_ids[r].diff() >= 0).all()
        assert b.input_ids.max() < 151936 and b.input_ids.min() >= 0


def test_pair_counts_match_the_trainers_dense_masks():
    b = synthetic_batches(1, 2, 256, 24, 1000, seed=3)[0]
    b = StaticBatch(**{**b.tensors(), "anchor_valid": b.anchor_valid.clone().index_fill_(1, torch.tensor([5]), False)})
    layout = make_layout(b.position_ids, b.doc_ids, b.anchor_pos, b.anchor_valid, 16)
    assert draft_pairs(b, 16) == float(dense_block_mask(layout).sum())
    assert target_pairs(b) == float(packed_causal_mask(b.doc_ids).sum())


@pytest.mark.slow
def test_accum_makes_one_step_of_several_micro_batches_and_docs_sets_the_documents_per_row():
    proc = bench(*TINY, "--steps", "1", "--warmup", "0", "--accum", "2", "--docs", "1", "--modes", "eager")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = results(proc.stdout)["eager"]
    assert r["tokens_per_step"] == 2 * 2 * 256  # accum x batch x seq
    assert r["flops"]["lm_head"] == 2 * (2 * (2 * 2) * 16 * 15 * 128 * 1024)
    assert r["docs_per_row"] == 1


def test_one_document_per_row_fills_the_row_and_docs_are_checked():
    from bench.step import parse

    (batch,) = synthetic_batches(1, 2, 64, 8, 100, seed=0, docs_per_row=1)
    assert (batch.doc_ids == 0).all() and (batch.position_ids == torch.arange(64)).all()
    for bad, says in [(["--docs", "0"], "--docs must be >= 1"), (["--seq", "64", "--anchors", "60", "--docs", "5"],
                                                                  "--anchors must be <= --seq - --docs")]:
        with pytest.raises(SystemExit, match=says):
            parse(["--shape", "tiny", *bad])


def test_head_fp8_takes_the_trainers_auto_or_1_or_0():
    from bench.step import parse
    from bench.step_run import step_config

    for flag, want in (("auto", "auto"), ("1", True), ("0", False)):
        cfg = parse(["--shape", "tiny", "--head-fp8", flag])[0]
        assert step_config(cfg, "compile+graph", "flex").head_fp8 == want
    assert parse(["--shape", "tiny"])[0].head_fp8 == "auto"
    with pytest.raises(SystemExit, match=r"unknown --head-fp8 'true'; choose one of \['auto', '1', '0'\]"):
        parse(["--shape", "tiny", "--head-fp8", "true"])


def test_the_table_compares_with_eager_only_when_eager_ran():
    from bench.step import table

    row = dict(tokens_per_s_per_gpu=2000.0, step_s_median=0.5, step_s_min=0.4, step_s_max=0.6, mfu=0.5,
               tflops_per_s=1.0, peak_alloc_gib=1.0, peak_reserved_gib=2.0)
    alone = table([dict(row, mode="compile+graph")])
    assert alone.splitlines()[1].split()[-1] == "-" and "nan" not in alone
    both = table([dict(row, mode="eager", tokens_per_s_per_gpu=1000.0), dict(row, mode="compile+graph")])
    assert both.splitlines()[2].split()[-1] == "2.00x"
