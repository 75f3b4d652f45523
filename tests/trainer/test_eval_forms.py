"""`trainer eval run | export | prompts`: each form's happy path on the tiny target (in process: the CLI's own
main), the form-less spelling naming the same forms, each form's --help showing its own flags, and a flag given to
the wrong form refused in one line naming the form it belongs to, before torch."""
import json

import pytest

from tests.trainer.conftest import REPO_ROOT, small_cfg
from tests.trainer.test_cli import error_lines, imported, run_cli
from trainer.cli.evalform import EvalRequest, eval_request
from trainer.cli.parser import build_parser

SMOKE = REPO_ROOT / "trainer" / "assets" / "smoke.jsonl"


def request(*argv) -> EvalRequest:
    return eval_request(build_parser().parse_args(["eval", *argv]))


@pytest.mark.parametrize("new, legacy", [
    (["run", "--run-dir", "R"], ["--run-dir", "R"]),
    (["export", "--drafter", "E", "--target", "T", "--data", "f.jsonl", "--max-bad-fraction", "0.5"],
     ["--drafter", "E", "--target", "T", "--data", "f.jsonl", "--max-bad-fraction", "0.5"]),
    (["prompts", "--drafter", "E", "--target", "T", "--prompts", "a.txt", "b.txt", "--limit", "3", "--engine", "hf"],
     ["--drafter", "E", "--target", "T", "--prompts", "a.txt", "b.txt", "--limit", "3", "--engine", "hf"]),
])
def test_the_form_less_spelling_names_the_same_request(new, legacy):
    assert request(*new) == request(*legacy)
    assert request(*new).form == new[0]


def test_prompt_defaults_apply_and_a_flag_before_the_form_is_kept():
    req = request("--limit", "3", "prompts", "--drafter", "E", "--target", "T", "--prompts", "a.txt")
    assert (req.limit, req.max_new, req.engine, req.target_dtype) == (3, 256, "static", "auto")
    assert req.prompts == ("a.txt",)


@pytest.mark.parametrize("args, message", [
    (["run", "--run-dir", "D", "--prompts", "p.txt"], "--prompts applies only to eval prompts, not to eval run"),
    (["run", "--run-dir", "D", "--target", "T"],
     "eval run evaluates the run's own export against the run's own target: drop --target, or evaluate an export "
     "with eval export --drafter EXPORT_DIR --target T --data F"),
    (["export", "--drafter", "X", "--target", "T", "--data", "f.jsonl", "--limit", "2", "--max-new", "9"],
     "--limit, --max-new apply only to eval prompts, not to eval export"),
    (["prompts", "--drafter", "X", "--target", "T", "--prompts", "p.txt", "--data", "f.jsonl"],
     "--data applies only to eval export, not to eval prompts"),
    (["export", "--run-dir", "D"], "--run-dir applies only to eval run, not to eval export"),
    (["export", "--drafter", "X", "--data", "f.jsonl"],
     "eval export needs --target: eval export --drafter EXPORT_DIR --target T --data F"),
    (["prompts", "--drafter", "X", "--target", "T"],
     "eval prompts needs --prompts: eval prompts --drafter EXPORT_DIR --target T --prompts FILE..."),
    (["run"], "eval run needs --run-dir: eval run --run-dir D"),
    (["prompts", "--drafter", "X", "--target", "T", "--prompts", "p.txt", "--max-new", "0"],
     "--max-new must be >= 2 (the first new token is the target's alone: one drafts nothing to measure), got 0"),
])
def test_a_flag_of_another_form_is_refused_naming_its_form_before_torch(tmp_path, args, message):
    p = run_cli("eval", *args, cwd=tmp_path, flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert error_lines(p.stderr) == [f"error: {message}"]
    assert "torch" not in imported(p.stderr)


def test_a_bare_eval_is_told_the_forms(tmp_path):
    p = run_cli("eval", cwd=tmp_path)
    assert p.returncode == 2 and error_lines(p.stderr) == [
        "error: eval needs a form: eval run --run-dir D | eval export --drafter EXPORT_DIR --target T --data F | "
        "eval prompts --drafter EXPORT_DIR --target T --prompts FILE...",
        "hint: python -m trainer eval FORM --help lists a form's flags"]


@pytest.mark.parametrize("form, own, foreign", [
    ("run", ["--run-dir"], ["--drafter", "--data", "--prompts", "--limit"]),
    ("export", ["--drafter", "--target", "--data", "--max-bad-fraction"], ["--run-dir", "--prompts", "--engine"]),
    ("prompts", ["--drafter", "--target", "--prompts", "--limit", "--max-new", "--engine", "--target-dtype"],
     ["--run-dir", "--data", "--max-bad-fraction"]),
])
def test_each_form_s_help_shows_its_own_flags(form, own, foreign):
    p = run_cli("eval", form, "--help")
    text = p.stdout
    assert p.returncode == 0 and text.startswith(f"usage: python -m trainer eval {form} ")
    assert all(f in text for f in own) and not [f for f in foreign if f in text], text


def test_eval_help_lists_the_forms():
    p = run_cli("eval", "--help")
    assert p.returncode == 0
    assert all(f"    {form} " in p.stdout for form in ("run", "export", "prompts")), p.stdout
    assert "--max-bad-fraction" not in p.stdout  # the form-less flags stay out of the page


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_target_dir):
    """A 2-step run of the tiny target with its export and a held-out split."""
    from trainer.train import train

    run = tmp_path_factory.mktemp("forms") / "run"
    train(small_cfg(tiny_target_dir, "optim.max_steps=2", "data.max_eval_rows=2"), run, environ={})
    return run


def _eval_records(capsys) -> list[dict]:
    return _eval_records_of(capsys.readouterr().out)


def _eval_records_of(out: str) -> list[dict]:
    return [json.loads(x.split(" ", 1)[1]) for x in out.splitlines() if x.startswith("DFLASH_EVAL ")]


def test_eval_run_evaluates_the_run_s_held_out_rows(trained_run, capsys):
    from trainer.__main__ import main

    assert main(["eval", "run", "--run-dir", str(trained_run)]) == 0
    [record] = _eval_records(capsys)
    assert 1.0 <= record["tau"] <= 16.0 and record["blocks"] > 0


def test_eval_export_evaluates_an_export_on_a_file(trained_run, tiny_target_dir, tmp_path, capsys):
    from trainer.__main__ import main

    data = tmp_path / "few.jsonl"
    data.write_text("".join(SMOKE.read_text().splitlines(keepends=True)[:8]))
    assert main(["eval", "export", "--drafter", str(trained_run / "export"), "--target", str(tiny_target_dir),
                 "--data", str(data)]) == 0
    [record] = _eval_records(capsys)
    assert 1.0 <= record["tau"] <= 16.0 and record["blocks"] > 0


def test_an_export_whose_weights_are_cut_short_or_others_is_one_line(trained_run, tiny_target_dir, tmp_path, capsys):
    """model.safetensors cut short (a copy that stopped), or another drafter's under this config.json: exit 2 naming
    the file, not a safetensors or load_state_dict traceback."""
    import shutil

    from trainer.__main__ import main

    data = tmp_path / "few.jsonl"
    data.write_text("".join(SMOKE.read_text().splitlines(keepends=True)[:8]))
    export = shutil.copytree(trained_run / "export", tmp_path / "export")
    weights = export / "model.safetensors"
    whole = weights.read_bytes()
    argv = ["eval", "export", "--drafter", str(export), "--target", str(tiny_target_dir), "--data", str(data)]
    weights.write_bytes(whole[:len(whole) // 2])
    assert main(argv) == 2
    assert f"error: {weights} cannot be read as safetensors (cut short or not one?): " in capsys.readouterr().err
    config = json.loads((export / "config.json").read_text())
    weights.write_bytes(whole)
    (export / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    assert main(argv) == 2
    assert f"error: {weights} does not hold the drafter its config.json describes: " in capsys.readouterr().err


def test_eval_export_on_rows_with_no_block_is_exit_3_not_a_tau_of_nothing(trained_run, tiny_target_dir, tmp_path,
                                                                        capsys):
    from trainer.__main__ import main

    held = tmp_path / "held.jsonl"  # no two consecutive supervised tokens: no block to draft
    held.write_text("".join(json.dumps({"input_ids": list(range(3, 11)), "loss_mask": [0, 1] * 4}) + "\n"
                            for _ in range(4)))
    assert main(["eval", "export", "--drafter", str(trained_run / "export"), "--target", str(tiny_target_dir),
                 "--data", str(held)]) == 3
    captured = capsys.readouterr()
    assert [r["blocks"] for r in _eval_records_of(captured.out)] == [0]
    assert "error: no block to evaluate: the rows hold no two consecutive supervised tokens" in captured.err


def test_eval_prompts_decodes_a_prompt_file(trained_run, tiny_target_dir, tmp_path, capsys):
    from trainer.__main__ import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("count from 1 to 4\nname three colours\n")
    assert main(["eval", "prompts", "--drafter", str(trained_run / "export"), "--target", str(tiny_target_dir),
                 "--prompts", str(prompts), "--limit", "1", "--max-new", "6"]) == 0
    [record] = _eval_records(capsys)
    assert record["set"] == "p" and record["prompts"] == 1 and record["identical"] == 1
