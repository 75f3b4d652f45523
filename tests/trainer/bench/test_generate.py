"""`python -m bench.generate` on CPU at the tiny shape: it prints consistent figures per engine and the ratio (not
timed here), and refuses bad arguments in one line."""
from __future__ import annotations

import json

import pytest

from bench import generate as bench


def test_bench_prints_its_figures_and_the_ratio(capsys):
    assert bench.main(["--shape", "tiny", "--batch", "3", "--prompt-tokens", "6", "--new-tokens", "5",
                       "--repeats", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = {tag: [json.loads(l.split(" ", 1)[1]) for l in out.splitlines() if l.startswith(tag + " ")]
             for tag in ("GENERATE_BENCH", "GENERATE_RATIO")}
    static, hf = lines["GENERATE_BENCH"]
    assert (static["engine"], hf["engine"]) == ("static", "hf") and static["attention"] == "sdpa"
    for r in (static, hf):
        assert r["generated_tokens"] == 3 * 5 and r["prompt_tokens"][1] == 6 and r["prompt_tokens"][0] >= 3
        assert r["tokens_per_s"] == pytest.approx(15 / r["wall_s"], rel=0.01)
        assert r["ms_per_token_step"] == pytest.approx(1e3 * r["wall_s"] / 5, rel=0.01) and r["peak_gib"] > 0
    ratio = lines["GENERATE_RATIO"][0]
    assert ratio["static_over_hf"] == pytest.approx(static["tokens_per_s"] / hf["tokens_per_s"], rel=0.01)
    assert ratio["greedy_rows_equal"] == 1.0  # fp32 on CPU: the two engines agree token for token
    assert "static / hf tokens/s:" in out


def test_bench_refuses_bad_arguments(capsys):
    for argv, needle in ((["--engines", "static,turbo"], "--engines must be"), (["--shape", "huge"], "unknown --shape"),
                         (["--batch", "0"], "--batch must be >= 1"), (["--top-p", "0"], "--top-p in (0, 1]")):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err
    assert bench.main(["--shape", "small", "--device", "cpu"]) == 2
    assert "GPU shape" in capsys.readouterr().err
    # the MoE and sink shapes pass the static engine's check (then meet the CPU's refusal); a hybrid does not
    for shape in ("qwen3-30b-a3b", "gpt-oss-20b"):
        assert bench.main(["--shape", shape, "--device", "cpu"]) == 2
        assert "GPU shape" in capsys.readouterr().err
    assert bench.main(["--shape", "qwen3.5-9b", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no decode layer for linear mixers" in err and "use --engines hf" in err
    assert bench.main(["--shape", "qwen3.5-9b", "--engines", "hf", "--device", "cpu"]) == 2
    assert "GPU shape" in capsys.readouterr().err
