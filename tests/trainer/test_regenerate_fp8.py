"""`regenerate --target-fp8`: the option is a setting of the answers (recorded in OUT.meta.json's settings; a resume
with it changed is refused), refused with --dtype float32 before torch, and refused in one line, exit 2, before the
tokenizer or any weight loads where the FP8 tensor cores are not (here: --device cpu, on any machine).
tests/trainer/decode/test_generate_fp8_gpu.py runs it on the H200."""
from __future__ import annotations

import pytest

from tests.trainer.test_regenerate import SMOKE, regenerate
from trainer.errors import ConfigError
from trainer.regen import outfile
from trainer.regen.plan import RegenSettings, check_settings


def test_fp8_is_a_setting_of_the_answers():
    """Off, the settings read as before the option existed (an older OUT resumes); on, they say so, and an OUT
    written with one resumes only with the same."""
    plain, fp8 = RegenSettings().output_settings(), RegenSettings(target_fp8=True).output_settings()
    assert "target_fp8" not in plain and fp8 == {**plain, "target_fp8": True}
    target = {"config_sha256": "abc"}
    outfile.check_same_run({"target": target, "settings": fp8}, target, fp8)
    for was, now in ((fp8, plain), (plain, fp8)):
        with pytest.raises(ConfigError, match="target_fp8"):
            outfile.check_same_run({"target": target, "settings": was}, target, now)
    check_settings(RegenSettings(target_fp8=True, dtype="bfloat16"))
    with pytest.raises(ConfigError, match="--target-fp8 runs the target in bfloat16"):
        check_settings(RegenSettings(target_fp8=True, dtype="float32"))


def test_without_fp8_tensor_cores_it_is_one_line_and_exit_2_before_the_weights_load(tiny_target_dir, tmp_path,
                                                                                      capsys):
    out = tmp_path / "out.jsonl"
    for engine in ("static", "hf"):
        code, lines, err = regenerate(capsys, "--target", str(tiny_target_dir), "--prompts", str(SMOKE), "--out",
                                      str(out), "--device", "cpu", "--target-fp8", engine=engine)
        errors = [ln for ln in err.splitlines() if not ln.startswith("hint:")]
        assert code == 2 and errors == ["error: --target-fp8 needs FP8 tensor cores (CUDA compute capability 9.0+); "
                                        "the target would be on cpu"], err
        assert "hint: leave out --target-fp8" in err
        said = "\n".join(lines)
        assert "loading torch" in said and "tokenizer" not in said and "loading the target" not in said
        assert not out.exists() and not outfile.meta_path(out).exists()
