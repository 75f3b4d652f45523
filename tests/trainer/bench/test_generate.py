"""`python -m bench.generate` on CPU at the tiny shape: it prints consistent figures per engine and the ratio (not
timed here), the mixed workload's answers end where they were drawn, the step's floor is what its formula says,
every family shape is taken, and bad arguments are refused in one line."""
from __future__ import annotations

import json

import pytest

from bench import generate as bench
from bench.generate_workloads import equal_mean_prompt


def test_bench_prints_its_figures_and_the_ratio(capsys):
    assert bench.main(["--shape", "tiny", "--batch", "3", "--prompt-tokens", "6", "--new-tokens", "5",
                       "--repeats", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = {tag: [json.loads(l.split(" ", 1)[1]) for l in out.splitlines() if l.startswith(tag + " ")]
             for tag in ("GENERATE_BENCH", "GENERATE_RATIO")}
    static, hf = lines["GENERATE_BENCH"]
    assert (static["engine"], hf["engine"]) == ("static", "hf") and static["attention"] == "sdpa"
    for r in (static, hf):
        assert r["workload"] == "equal" and r["asked"] == r["engine"] and r["floor_ms"] > 0 and "note" not in r
        assert "linear_step" not in r  # a dense target has no Gated DeltaNet step
        assert r["target_fp8"] is False and "fp8_linears" not in r
        assert r["generated_tokens"] == 3 * 5 and r["prompt_tokens"][1] == 6 and r["prompt_tokens"][0] >= 3
        assert r["tokens_per_s"] == pytest.approx(15 / r["wall_s"], rel=0.01)
        assert r["ms_per_token_step"] == pytest.approx(1e3 * r["wall_s"] / 5, rel=0.01) and r["peak_gib"] > 0
    # 3 rows of 5 tokens: 4 steps, each row live in all (each answer's first token is its prefill's)
    assert (static["steps"], static["busy"], static["fills"], static["prefills"]) == (4, 1.0, 1, 1)
    assert (static["held"], static["tail_steps"]) == (1.0, 4)
    assert "EQUAL_LIKE" not in out  # the equal workload is its own comparison
    ratio = lines["GENERATE_RATIO"][0]
    assert ratio["static_over_hf"] == pytest.approx(static["tokens_per_s"] / hf["tokens_per_s"], rel=0.01)
    assert ratio["greedy_rows_equal"] == 1.0  # fp32 on CPU: the two engines agree token for token
    assert "static / hf tokens/s:" in out and "floor ms" in out


def test_the_mixed_workload_answers_end_on_the_stop_id_where_they_were_drawn(capsys):
    argv = ["--shape", "tiny", "--workload", "mixed", "--batch", "3", "--prompts", "5", "--prompt-tokens", "12",
            "--min-prompt-tokens", "4", "--new-tokens", "9", "--mean-new-tokens", "4", "--seed", "5",
            "--repeats", "1", "--device", "cpu"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    tagged = {tag: [json.loads(l.split(" ", 1)[1]) for l in out.splitlines() if l.startswith(tag + " ")]
              for tag in ("GENERATE_BENCH", "GENERATE_RATIO", "GENERATE_FLOOR", "EQUAL_LIKE")}
    lengths = bench.mixed_lengths(5, 5, 4, 12, 4, 9)
    assert lengths == bench.mixed_lengths(5, 5, 4, 12, 4, 9) and lengths[0] == (12, 9)  # seeded
    assert all(4 <= p <= 12 and 1 <= a <= 9 for p, a in lengths) and len({a for _, a in lengths}) > 1
    floor = tagged["GENERATE_FLOOR"][0]
    assert floor["rows"] == 3 and floor["context"] == pytest.approx(sum(p + a / 2 for p, a in lengths) / 5, abs=0.1)
    assert floor["hbm_bytes_per_s"] == 4.8e12 and floor["gemm_flops_per_s"] == 790e12
    for r in tagged["GENERATE_BENCH"]:
        assert r["workload"] == "mixed" and r["prompts"] == 5 and r["batch"] == 3
        assert r["prompt_tokens"] == [min(p for p, _ in lengths), 12]
        assert r["answers_as_drawn"] == 1.0 and r["generated_tokens"] == sum(a for _, a in lengths)
        assert r["ms_per_token_step"] == pytest.approx(1e3 * r["wall_s"] * 3 / r["generated_tokens"], rel=0.01)
        assert r["floor_ms"] == pytest.approx(floor["floor_ms"], abs=1e-3)
    assert tagged["GENERATE_RATIO"][0]["greedy_rows_equal"] == 1.0
    static, hf = tagged["GENERATE_BENCH"]
    assert all(k not in hf for k in bench.RUN_FIELDS)  # HF generate's steps are not counted
    # the static engine's counts: 5 prompts through 3 rows, each prompt prefilled once, in forwards at least as
    # wide as its tokens; a live row generates one token per step (each answer's first is its prefill's)
    assert static["fills"] >= 2 and static["prefills"] >= static["fills"] and static["checks"] >= static["fills"] - 1
    assert static["prefill_tokens"] == sum(p for p, _ in lengths) <= static["prefill_positions"]
    assert static["busy"] == pytest.approx((static["generated_tokens"] - 5) / (static["steps"] * 3), abs=1e-4)
    assert static["steps"] >= max(a for _, a in lengths) - 1 and 0 < static["busy"] <= static["held"] <= 1
    assert 0 < static["tail_steps"] < static["steps"]
    assert static["prefill_s"] > 0 and static["step_s"] > 0 and static["prefill_s"] + static["step_s"] <= \
        static["wall_s"] * 1.01  # the last timed run's; repeats 1: the wall's own run
    # CPU without the per-row kernel: no step compacts, each computes every row
    assert (static["compact_steps"], static["slot_steps"]) == (0, static["steps"] * 3)
    assert static["busy_computed"] == static["busy"]
    assert f"{static['steps']} steps ({static['tail_steps']} in the tail, 0 compacted), busy" in out
    like = tagged["EQUAL_LIKE"][0]
    assert like == bench.equal_like(3, [p for p, _ in lengths], [a for _, a in lengths], "tiny",
                                    "--repeats 1 --device cpu")
    assert like["command"].startswith("python3 -m bench.generate --shape tiny --batch 3 --prompt-tokens ")


def test_the_equal_like_workload_has_the_mixed_means():
    """Mean prompt 250, mean answer 20.33 at 4 rows: the equal draw's first prompt is the longest and the other 3
    uniform in [ceil(P / 2), P], mean (P + 3 (ceil(P / 2) + P) / 2) / 4: 249.625 at P = 307, 250.25 at 308 (nearer);
    --new-tokens 20. The qwen3-8b mixed workload (2,048 prompts, seed 1) compares with --prompt-tokens 724 and
    --new-tokens 510 at 256 rows (mean prompt 543.5, mean answer 510.3)."""
    assert equal_mean_prompt(307, 4) == 249.625 and equal_mean_prompt(308, 4) == 250.25
    like = bench.equal_like(4, [100, 200, 300, 400], [10, 20, 31], "small", "--repeats 2")
    assert like == {"rows": 4, "mean_prompt": 250.0, "mean_answer": 20.3, "prompt_tokens": 308, "new_tokens": 20,
                    "equal_mean_prompt": 250.2, "command": "python3 -m bench.generate --shape small --batch 4 "
                    "--prompt-tokens 308 --new-tokens 20 --engines static --repeats 2"}
    lengths = bench.mixed_lengths(2048, 1, 64, 1024, 512, 2048)
    big = bench.equal_like(256, [p for p, _ in lengths], [a for _, a in lengths], "qwen3-8b")
    assert (big["prompt_tokens"], big["new_tokens"], big["mean_prompt"]) == (724, 510, 543.5)
    assert big["command"].endswith("--new-tokens 510 --engines static")


def test_the_step_floor_of_the_8b_shape_at_batch_256():
    """Qwen3-8B, 256 rows at a 320-token context: 7.57B weights read (the head included, the embedding a gather)
    and 256 x 320 tokens of 36 x 2 x 8 x 128 bf16 KV, at 4.8 TB/s; the GEMMs, 2 x 256 x those weights at 790
    TFLOP/s, take less."""
    from bench.floor import experts_touched, step_floor
    from bench.shapes import target_config

    f = step_floor(target_config("qwen3-8b", 4096), 256, 320)
    d, layers = 4096, 36
    per_layer = d * 32 * 128 + 2 * d * 8 * 128 + 32 * 128 * d + 3 * d * 12288
    weights = 2 * (layers * per_layer + d * 151936)
    kv = 256 * 320 * layers * 2 * 8 * 128 * 2
    assert f["weight_bytes"] == weights and f["kv_bytes"] == kv
    assert f["memory_ms"] == pytest.approx(1e3 * (weights + kv) / 4.8e12)
    assert f["compute_ms"] == pytest.approx(1e3 * (256 * weights + 4 * 128 * 32 * 320 * 256 * layers) / 790e12)
    assert f["floor_ms"] == max(f["memory_ms"], f["compute_ms"]) == pytest.approx(5.67, abs=0.01)
    # MoE: at 256 rows nearly every expert is read; at 1 row, top-k of them
    assert experts_touched(128, 8, 1) == pytest.approx(8) and experts_touched(128, 8, 256) > 127.9
    one, many = (step_floor(target_config("qwen3-30b-a3b", 4096), rows, 320) for rows in (1, 256))
    assert one["weight_bytes"] < many["weight_bytes"] / 5
    # a sliding-window layer reads its window; a Gated DeltaNet layer reads and writes its fp32 state
    oss = step_floor(target_config("gpt-oss-20b", 4096), 4, 1000)
    assert oss["kv_bytes"] == 4 * (12 * 128 + 12 * 1000) * 2 * 8 * 64 * 2
    hybrid = step_floor(target_config("qwen3.5-9b", 4096), 4, 1000)
    assert hybrid["state_bytes"] == 24 * 2 * 4 * 32 * 128 * 128 * 4
    assert hybrid["kv_bytes"] == 4 * 1000 * 8 * 2 * 4 * 256 * 2


def test_every_family_shape_is_taken_and_the_static_engine_says_where_it_does_not_serve(family_dirs, tmp_path):
    """--shape names every family of bench/shapes.py; the static engine runs gpt-oss (and the MoE families) and the
    hybrids, dense and MoE; on a target it refuses (dynamic RoPE), the static engine's run is HF generate with a note
    (tiny targets: the shapes themselves are GPU-sized)."""
    from tests.trainer.families import REFUSED_BY_STATIC, build_family_target
    from bench.shapes import SHAPES
    from trainer.model.target import load_target

    for shape in ("qwen3.5-9b", "qwen3-30b-a3b", "gpt-oss-20b", "qwen3.5-35b-a3b", "qwen3-8b"):
        assert shape in SHAPES and bench.parse(["--shape", shape]).shape == shape
    oss = load_target(family_dirs["gpt_oss"], num_draft_layers=1, truncate=False)
    _run, used, note, gen = bench.engine_run("static", oss, rows=2, max_len=32, stops=[0])
    assert used == "static" and note is None and gen is not None
    from trainer.decode.generate import Sampling

    for family in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
        hybrid = load_target(family_dirs[family], num_draft_layers=1, truncate=False)
        _run, used, note, gen = bench.engine_run("static", hybrid, rows=2, max_len=32, stops=[0])
        assert used == "static" and note is None and gen is not None, family
        figures, answers = bench.measure("static", hybrid, [[1, 2, 3], [4, 5]], 2, Sampling(max_new_tokens=3), 1,
                                         [0])
        assert figures["engine"] == "static" and figures["attention"] == "sdpa" and len(answers) == 2, family
        assert figures["linear_step"] == "torch", family  # CPU: the torch rule (CUDA with fla: "fused")
    target = load_target(build_family_target(tmp_path / "refused", REFUSED_BY_STATIC), num_draft_layers=1,
                         truncate=False)
    run, used, note, gen = bench.engine_run("static", target, rows=2, max_len=32, stops=[0])
    assert gen is None and note.startswith("the static engine cannot serve llama") and "measured HF generate" in note
    assert len(run([[1, 2, 3], [4, 5]], __import__("trainer.decode.generate", fromlist=["Sampling"]).Sampling(
        max_new_tokens=3))) == 2


def test_bench_refuses_bad_arguments(capsys):
    for argv, needle in ((["--engines", "static,turbo"], "--engines must be"), (["--shape", "huge"], "unknown --shape"),
                         (["--workload", "mixed", "--shape", "tiny", "--new-tokens", "1024"], "below the vocabulary"),
                         (["--workload", "mixed", "--temperature", "0.5"], "is greedy"),
                         (["--workload", "mixed", "--min-prompt-tokens", "2000"], "--min-prompt-tokens <="),
                         (["--batch", "0"], "--batch must be >= 1"), (["--top-p", "0"], "--top-p in (0, 1]")):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err
    assert bench.main(["--shape", "small", "--device", "cpu"]) == 2
    assert "GPU shape" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_5_moe"])
def test_the_chain_target_answers_the_drawn_length_in_every_family(family, family_dirs):
    """The mixed workload's chain rule (every residual write zeroed, the head a permutation of the embeddings)
    holds in each family's layers: a prompt ending 5 steps before the stop id answers those 5 tokens."""
    from trainer.decode.generate import Sampling, hf_generate
    from trainer.model.target import load_target

    target = load_target(family_dirs[family], num_draft_layers=1, truncate=False)
    order = bench.make_chain(target.model, seed=3)
    prompts = bench.mixed_prompts([(6, 5), (3, 2)], order, seed=3)
    answers = hf_generate(target.model, prompts, Sampling(max_new_tokens=9), [order[0]], pad_id=0)
    assert answers == [order[-4:] + [order[0]], order[-1:] + [order[0]]]


def test_target_fp8_is_parsed_and_refused_in_one_line_where_it_cannot_run(capsys):
    """--target-fp8 0|1 (default 0); with --dtype float32 a usage error; on a CPU (no FP8 tensor cores) exit 2 before
    the target is built (no GENERATE_FLOOR line). tests/trainer/decode/test_generate_fp8_gpu.py runs it on CUDA."""
    assert bench.parse([]).target_fp8 == 0 and bench.parse(["--target-fp8", "1"]).target_fp8 == 1
    for argv, needle in ((["--target-fp8", "2"], "invalid choice"),
                         (["--target-fp8", "1", "--dtype", "float32"], "--target-fp8 1 runs the target in bfloat16")):
        with pytest.raises(SystemExit) as e:
            bench.parse(argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--target-fp8", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ("error: --target-fp8 1 needs FP8 tensor cores (CUDA compute capability 9.0+); "
                                    "the target would be on cpu") and "GENERATE" not in captured.out


def test_kernels_off_are_parsed_switched_and_recorded(capsys, monkeypatch):
    """--kernels-off NAME,... switches decode kernels off (trainer/decode/switches.py); an unknown name, there or in
    DFLASH_DECODE_KERNELS_OFF, is a usage error; each line records the kernels off and the layers each kernel took."""
    from trainer.decode import switches

    assert bench.parse([]).kernels_off == [] and bench.parse(["--kernels-off", "moe"]).kernels_off == ["moe"]
    with pytest.raises(SystemExit):
        bench.parse(["--kernels-off", "moe,warp-drive"])
    assert "--kernels-off: no decode kernel 'warp-drive'" in capsys.readouterr().err
    monkeypatch.setattr(switches, "_off", None)  # read the environment afresh
    monkeypatch.setenv(switches.ENV, "conv,warp")
    with pytest.raises(SystemExit):
        bench.parse([])
    assert f"{switches.ENV}: no decode kernel 'warp'" in capsys.readouterr().err
    monkeypatch.setattr(switches, "_off", None)
    monkeypatch.setenv(switches.ENV, "conv")
    assert bench.main(["--shape", "tiny", "--batch", "2", "--prompt-tokens", "4", "--new-tokens", "2",
                       "--repeats", "1", "--engines", "static", "--device", "cpu", "--kernels-off", "moe"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("GENERATE_BENCH"))
    figures = json.loads(line.split(" ", 1)[1])
    assert figures["kernels_off"] == ["conv", "moe"] and not switches.on("moe") and switches.on("route")
    # the tiny dense target: no MoE layer to take the kernels, and the line says so
    assert figures["kernel_layers"] == {"moe": 0, "route": 0, "overlap": 0, "conv": 0}


def test_profile_is_parsed_and_refused_in_one_line_on_a_cpu(capsys):
    """--profile N (default 0, off); negative is a usage error; N > 0 without CUDA exits 2 before the target is built
    (no GENERATE_FLOOR line). The profile itself is bench/timing.py's (tests/trainer/bench/test_timing.py)."""
    assert bench.parse([]).profile == 0 and bench.parse(["--profile", "2"]).profile == 2
    with pytest.raises(SystemExit) as e:
        bench.parse(["--profile", "-1"])
    assert e.value.code == 2 and "--profile must be >= 0" in capsys.readouterr().err
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--profile", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == "error: --profile 1 profiles CUDA kernels; this run is on cpu"
    assert "GENERATE" not in captured.out


def test_token_steps_are_the_static_replays_or_each_hf_chunks_longest_answer():
    """The profile's divisor: the static engine's step replays of its last run; HF generate steps each chunk of
    `rows` until its longest answer ends."""
    class Replayed:
        replays = 7

    assert bench.token_steps(Replayed(), [[1]] * 4, rows=2) == 7
    assert bench.token_steps(None, [[1, 2], [3], [4, 5, 6], [7]], rows=2) == 2 + 3
    assert bench.token_steps(None, [[1, 2], [3], [4]], rows=2) == 2 + 1


@pytest.mark.parametrize("row_kernel", [True, False])
def test_the_warm_up_captures_every_graph_the_timed_run_replays(request, two_layer_dirs, row_kernel):
    """With the per-row attention kernel a short warm-up (the first batch, a few new tokens) captures the one step
    graph; through masked SDPA the warm-up is the whole workload (spans of 16 and 32 slots here). Either way the
    timed run captures nothing new. A two-layer target: the interpreter's cost is per layer."""
    from tests.trainer.decode.test_generate import prompts_of
    from tests.trainer.families import load_two_layers
    from trainer.decode.generate import BatchGenerator, Sampling

    if row_kernel:  # the kernel on CPU tensors: under Triton's interpreter
        request.getfixturevalue("interpreter")
    target = load_two_layers(two_layer_dirs["qwen3"])
    prompts = prompts_of(target, (3, 20, 5), seed=2)
    gen = BatchGenerator(target, rows=2, max_len=60, stop_ids=[], row_kernel=row_kernel)
    assert gen.static.row_kernel == row_kernel
    sampling = Sampling(max_new_tokens=9)
    warm, warm_sampling = bench.warm_up(prompts, sampling, 2, gen, new_tokens=3)
    if row_kernel:
        assert warm == prompts[:2] and warm_sampling.max_new_tokens == 3
    else:
        assert (warm, warm_sampling) == (prompts, sampling)
    gen.generate(warm, warm_sampling)
    captured = set(gen.programs)
    gen.generate(prompts, sampling)
    assert set(gen.programs) == captured and gen.replays > 9
