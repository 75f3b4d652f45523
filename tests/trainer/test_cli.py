"""The CLI end to end in subprocesses, as the runbooks call it."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.trainer.conftest import REPO_ROOT

PHASE = re.compile(r"^\[ *\d+\.\ds\] ")  # a console line (trainer/metrics.py Console)


def run_cli(*args, cwd=None, flags=()):
    """`python [flags] -m trainer args`, waited for until it exits (the session's pytest timeout guards hangs)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, *flags, "-m", "trainer", *args], capture_output=True, text=True, env=env,
                          cwd=cwd or REPO_ROOT)


def imported(stderr: str) -> set[str]:
    """Top-level packages a `python -X importtime` run imported (its `import time: self | cumulative | name` lines)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def trainer_liveness_patterns() -> dict[str, re.Pattern]:
    """The liveness pattern of every shipped runbook that runs `trainer train`."""
    out = {}
    for path in sorted((REPO_ROOT / "runbooks").glob("*.yaml")):
        book = yaml.safe_load(path.read_text())
        command = book["command"]
        if "trainer" in command and "train" in command:
            out[path.stem] = re.compile(book["liveness"]["pattern"])
    return out


SHORT_SETS = ("optim.max_steps=4", "ckpt.every=2", "log.every=2", "data.seq_len=96", "data.rows_per_step=2",
              "data.num_anchors=8", "eval_at_end=false")


def short_argv(run_dir, target) -> list[str]:
    """`train` of a short smoke run: 4 steps, metrics at 2 and 4, checkpoints at 2 and 4, an export, no eval."""
    sets = [f"model.target={target}", *SHORT_SETS]
    return ["train", "--recipe", "smoke", "--run-dir", str(run_dir), *[x for s in sets for x in ("--set", s)]]


@pytest.fixture(scope="module")
def finished_short_run(tmp_path_factory, tiny_target_dir):
    """One finished `short_argv` run on the session's tiny target, trained once for the tests that start from such a
    run: (the process, its run dir). Each of them asserts the exit status and works on its own copy of the dir."""
    run = tmp_path_factory.mktemp("short") / "run"
    return run_cli(*short_argv(run, tiny_target_dir)), run


def copy_of_short_run(finished_short_run, dest):
    """`dest`: a copy of the module's finished short run (asserted finished: its failure fails the caller)."""
    import shutil

    p, run = finished_short_run
    assert p.returncode == 0, p.stderr[-3000:]
    return shutil.copytree(run, dest)


@pytest.mark.slow
def test_train_export_eval_end_to_end(tmp_path, tiny_target_dir):
    run_dir = tmp_path / "run"
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(run_dir), "--set", f"model.target={tiny_target_dir}",
                "--set", "optim.max_steps=6", "--set", "log.every=2", "--set", "ckpt.every=3", "--set",
                "data.seq_len=128", "--set", "data.max_eval_rows=4")
    assert p.returncode == 0, p.stderr
    assert "packs into" not in p.stderr  # the bundled data fills many steps: no small-data warning
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("DFLASH_METRICS ")]
    records = [json.loads(ln[len("DFLASH_METRICS "):]) for ln in lines]
    assert [r["step"] for r in records] == [2, 4, 6]
    assert all(len(r["acc_by_pos"]) == 15 and r["tokens_per_s"] > 0 and "lr" in r for r in records)
    assert any(ln.startswith("step 2/6 ") for ln in p.stdout.splitlines())  # the human line
    done = [ln for ln in p.stdout.splitlines() if ln.startswith("DFLASH_DONE ")]
    assert len(done) == 1 and json.loads(done[0][len("DFLASH_DONE "):])["step"] == 6
    # The console says what the run does from its first line on, each phase with its time ...
    out = p.stdout.splitlines()
    assert PHASE.match(out[0]) and float(out[0][1:out[0].index("s]")]) < 3.0, out[:3]  # 0.0s on an idle box
    phases = [ln for ln in out if PHASE.match(ln)]
    for what in ("checking the config", "loading torch", "loading the tokenizer", "reading and tokenizing the data",
                 "loading the target", "building the drafter", "writing the last checkpoint", "writing the export",
                 "evaluating the simulated tau"):
        begun = [ln for ln in phases if what in ln and ln.endswith(" ...")]
        ended = [ln for ln in phases if what in ln and re.search(r": \d+\.\ds( \(.*\))?$", ln)]
        assert len(begun) == len(ended) == 1, (what, phases)
    assert out.index(next(ln for ln in phases if "reading and tokenizing" in ln)) < \
        out.index(next(ln for ln in phases if "loading the target" in ln))  # data before the model
    # ... and none of its lines can pass for training in a runbook's liveness check.
    patterns = trainer_liveness_patterns()
    assert {"smoke", "graphwarm", "eager"} <= set(patterns)
    for line in phases:
        assert not [name for name, pat in patterns.items() if pat.search(line)], line
    # The end names the export and tau plainly.
    tau = json.loads(next(ln for ln in out if ln.startswith("DFLASH_EVAL "))[len("DFLASH_EVAL "):])["tau"]
    assert out[-3] == (f"run finished after 6 optimizer steps: export {run_dir / 'export'}, simulated tau {tau:.2f} "
                       f"(on {json.loads(done[0][len('DFLASH_DONE '):])['eval']['blocks']} held-out blocks)")
    # ... and how to serve it: each stack's command, pasteable; vLLM told the block less one (it reads no block size)
    sglang, vllm = (shlex.split(ln.split(": ", 1)[1]) for ln in out[-2:])
    assert sglang[sglang.index("--model-path") + 1] == str(tiny_target_dir)
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == str(run_dir / "export")
    assert vllm[:3] == ["vllm", "serve", str(tiny_target_dir)] and json.loads(vllm[4]) == {
        "method": "dflash", "model": str(run_dir / "export"), "num_speculative_tokens": 15}
    assert json.loads((run_dir / "config.json").read_text())["model"]["target"] == str(tiny_target_dir)
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6]
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == ["step_3", "step_6"]
    cfg = json.loads((run_dir / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3] and cfg["num_target_layers"] == 6
    assert cfg["num_hidden_layers"] == 2

    from safetensors.torch import load_file
    names = set(load_file(str(run_dir / "export" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_proj.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)

    ev = run_cli("eval", "--run-dir", str(run_dir))
    assert ev.returncode == 0, ev.stderr
    result = json.loads(next(ln for ln in ev.stdout.splitlines() if ln.startswith("DFLASH_EVAL "))[12:])
    assert 1.0 <= result["tau"] <= 16.0 and result["blocks"] > 0 and len(result["accept_by_pos"]) == 15

    ex = run_cli("export", "--run-dir", str(run_dir))
    assert ex.returncode == 0, ex.stderr
    assert ex.stdout.splitlines()[-2:] == out[-2:]  # the same serving commands
    data = REPO_ROOT / "trainer" / "assets" / "smoke.jsonl"
    ev2 = run_cli("eval", "--drafter", str(run_dir / "export"), "--target", str(tiny_target_dir), "--data", str(data))
    assert ev2.returncode == 0, ev2.stderr
    assert "DFLASH_EVAL " in ev2.stdout


def test_bad_set_is_one_clear_line_and_exit_2_before_torch_is_imported(tmp_path):
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), "--set", "optim.lrr=1",
                flags=("-X", "importtime"))
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.splitlines() if not ln.startswith("import time:")]
    assert len(errors) == 1 and errors[0].startswith("error: unknown config key 'optim.lrr' (did you mean "
                                                     "'optim.lr'?); valid keys here: lr,")
    modules = imported(p.stderr)
    assert {"trainer", "yaml"} <= modules and "torch" not in modules and "transformers" not in modules
    assert not (tmp_path / "r").exists()


def test_an_unknown_decode_kernel_switched_off_is_one_line_and_exit_2_before_torch(tmp_path, monkeypatch):
    """DFLASH_DECODE_KERNELS_OFF (trainer/decode/switches.py) is read by every command before it starts."""
    monkeypatch.setenv("DFLASH_DECODE_KERNELS_OFF", "moe,warp")
    p = run_cli("make-tiny-target", str(tmp_path / "t"), flags=("-X", "importtime"))
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.splitlines() if not ln.startswith("import time:")]
    assert errors == ["error: DFLASH_DECODE_KERNELS_OFF: no decode kernel 'warp'; the names are moe, route, overlap, "
                      "conv"]
    assert "torch" not in imported(p.stderr) and not (tmp_path / "t").exists()


def test_the_import_check_sees_torch_when_the_cli_loads_it(tmp_path, tiny_target_dir):
    """The control for the test above: a refusal that needs torch (is there a GPU?) shows torch in the same check."""
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), "--set",
                f"model.target={tiny_target_dir}", "--set", "step.mode=graph", flags=("-X", "importtime"))
    assert p.returncode == 2 and "error: step.mode=graph needs a CUDA device (this run is on cpu)" in p.stderr
    assert "torch" in imported(p.stderr)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("sets, message", [
    (("data.paths=[/nonexistent/x.jsonl]",), "error: data file not found: /nonexistent/x.jsonl"),
    (("model.target=/nonexistent/target",), "error: model.target=/nonexistent/target: no config.json there"),
])
def test_missing_files_are_refused_before_torch(tmp_path, sets, message):
    args = [x for s in sets for x in ("--set", s)]
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), *args, flags=("-X", "importtime"))
    assert p.returncode == (3 if "data" in message else 2), p.stderr[-2000:]
    assert message in p.stderr and "torch" not in imported(p.stderr)
    assert not (tmp_path / "r").exists()


def test_a_target_dir_that_cannot_load_is_refused_before_torch(tmp_path):
    """train reads the target directory as regenerate does: its family, weights and tokenizer files."""
    from tests.trainer.test_regenerate import fake_target

    cases = {
        fake_target(tmp_path / "odd", {"model_type": "no-such-family"}): "unknown family 'no-such-family'",
        fake_target(tmp_path / "hyb", {"model_type": "jamba"}): "target family 'jamba'",
        fake_target(tmp_path / "now", {"model_type": "qwen3", "num_hidden_layers": 8}, weights=False): "no weights",
    }
    for target, message in cases.items():
        p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), "--set", f"model.target={target}",
                    flags=("-X", "importtime"))
        errors = [ln for ln in p.stderr.splitlines() if not ln.startswith(("import time:", "hint:"))]
        assert p.returncode == 2 and len(errors) == 1 and message in errors[0], p.stderr[-2000:]
        assert "torch" not in imported(p.stderr) and not (tmp_path / "r").exists()


def test_a_mask_id_the_tokenizer_refuses_stops_the_start_before_the_data_and_the_weights(tmp_path, tiny_target_dir):
    """The mask id needs the tokenizer and the embedding's rows only: an eos mask id is refused right after the
    tokenizer loads, before the data is tokenized and the target's weights load."""
    import json

    eos = json.loads((tiny_target_dir / "config.json").read_text())["eos_token_id"]
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), "--set",
                f"model.target={tiny_target_dir}", "--set", f"model.mask_token_id={eos}")
    assert p.returncode == 2 and f"error: mask token id {eos} (model.mask_token_id) is the" in p.stderr, p.stderr
    assert "loading the tokenizer" in p.stderr + p.stdout
    assert "tokenizing the data" not in p.stderr + p.stdout and "loading the target" not in p.stderr + p.stdout


def test_a_leading_tilde_is_the_home_directory_as_the_shell_would_have_made_it(tmp_path, monkeypatch):
    """`--set model.target=~/m` and `--target=~/m` reach the trainer with `~` unexpanded: it expands it itself."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r").write_text("a file")
    cases = [
        (("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "x"), "--set", "model.target=~/nope"),
         f"model.target={tmp_path}/nope: no config.json there"),
        (("train", "--recipe", "smoke", "--run-dir", "~/runs/r"), f"--run-dir {tmp_path}/runs/r is an existing file"),
        (("regenerate", "--target=~/nope", "--prompts", "p.txt", "--out", str(tmp_path / "o.jsonl")),
         f"target directory {tmp_path}/nope does not exist"),
    ]
    for args, message in cases:
        p = run_cli(*args)
        assert p.returncode == 2 and message in p.stderr, (args, p.stderr)


@pytest.mark.slow
def test_resume_needs_no_set_it_reads_the_runs_own_config(tmp_path, finished_short_run):
    """`train --recipe gpu --run-dir R --resume`, as the README shows it: the run's config.json is the config, so the
    --set values of the first start need not be repeated; a --set that would change what is trained is refused."""
    run = copy_of_short_run(finished_short_run, tmp_path / "run")  # started with --recipe smoke and --set values
    again = run_cli("train", "--recipe", "gpu", "--run-dir", str(run), "--resume", "--set", "log.every=1")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"checking the config ({run}/config.json, as the run started; --recipe gpu not used)" in again.stdout
    other = run_cli("train", "--recipe", "smoke", "--run-dir", str(run), "--resume", "--set", "optim.lr=1e-2")
    assert other.returncode == 2 and "--resume with a different config: optim.lr" in other.stderr, other.stderr
    assert "hint: a resume continues with the run's own config.json: drop the --set values that change it" in \
        other.stderr and "same recipe" not in other.stderr


def test_a_recipe_that_is_none_is_refused_with_resume_too(tmp_path):
    """A runbook's command names its recipe on a resume as well (so --recipe is not refused with --resume), but a
    recipe that is not one is not silently ignored: one line, exit 2, before torch."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"seed": 0}\n')  # a run's config; nothing gets past the recipe
    p = run_cli("train", "--recipe", "nonesuch", "--run-dir", str(run), "--resume", flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert [line.split(";")[0] for line in error_lines(p.stderr)] == ["error: unknown recipe 'nonesuch'"]
    assert "torch" not in imported(p.stderr) and sorted(x.name for x in run.iterdir()) == ["config.json"]


def test_an_empty_target_is_refused_outside_the_smoke_recipe(tmp_path):
    p = run_cli("train", "--recipe", "gpu", "--run-dir", str(tmp_path / "r"), flags=("-X", "importtime"))
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.splitlines() if not ln.startswith("import time:")]
    assert errors[0] == "error: model.target is empty: set model.target=DIR (a local Hugging Face model directory)"
    assert "torch" not in imported(p.stderr) and not (tmp_path / "r").exists()


def test_a_pipeline_recipe_is_refused_in_one_line_naming_the_pipeline(tmp_path):
    p = run_cli("train", "--recipe", "quality_gpu", "--run-dir", str(tmp_path / "r"))
    assert p.returncode == 2
    assert p.stderr.splitlines() == ["error: quality_gpu is a quality-pipeline recipe, not a trainer recipe: run "
                                     "python -m trainer.quality.pipeline --recipe quality_gpu --out DIR"]


def test_train_help_lists_the_recipes_train_accepts():
    from trainer.config import bundled_recipes, load_config

    p = run_cli("train", "--help")
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    kinds = bundled_recipes()
    train = [n for n, k in kinds.items() if k == "train"]
    pipeline = [n for n, k in kinds.items() if k == "pipeline"]
    assert {"smoke", "gpu"} <= set(train) and {"quality_cpu", "quality_gpu"} <= set(pipeline)
    assert f"a bundled trainer recipe ({', '.join(train)}) or a PATH.yaml" in text
    assert f"{', '.join(pipeline)}: quality-pipeline recipes, for python -m trainer.quality.pipeline" in text
    for name in train:
        load_config(name)  # every recipe the help offers is one train accepts


def test_bad_data_exits_3_with_line_numbers_before_torch_and_lists_every_line(tmp_path, tiny_target_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n" * 3 + "\n".join(["{oops"] * 11) + "\n")
    run_dir = tmp_path / "r"
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(run_dir), "--set",
                f"model.target={tiny_target_dir}", "--set", f"data.paths=[{bad}]", flags=("-X", "importtime"))
    assert p.returncode == 3, p.stderr
    assert "bad.jsonl:1 (invalid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1))" \
        in p.stderr and "bad.jsonl:3" in p.stderr
    assert f"and 4 more (every one listed in {run_dir / 'bad_lines.txt'})" in p.stderr
    assert "torch" not in imported(p.stderr)
    listed = (run_dir / "bad_lines.txt").read_text().splitlines()
    assert [ln.split(":")[1] for ln in listed] == [str(i) for i in range(1, 15)]
    assert sorted(x.name for x in run_dir.iterdir()) == ["bad_lines.txt"]  # nothing else of a failed start


def test_a_line_of_invalid_utf8_is_a_malformed_line_with_its_number(tmp_path, tiny_target_dir):
    good = (REPO_ROOT / "trainer" / "assets" / "smoke.jsonl").read_bytes().split(b"\n")[:5]
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\n".join(good[:2] + [b'{"conversations": "\xff\xfe"}'] + good[2:]) + b"\n")
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), "--set",
                f"model.target={tiny_target_dir}", "--set", f"data.paths=[{data}]")
    assert p.returncode == 3, p.stderr
    assert "Traceback" not in p.stderr
    assert f"{data}:3 (invalid UTF-8 at byte 20 of the line (invalid start byte))" in p.stderr


@pytest.mark.slow
def test_a_failed_start_leaves_nothing_behind_and_keeps_what_was_there(tmp_path, tiny_target_dir, monkeypatch):
    """Data the tokenizer refuses (no assistant turn) is found before any model is built; taps that do not fit the
    target (5 draft layers on 6 target layers: no tap spacing) are found before anything loads, the tiny target's
    included; a failure after the tiny target was built (a tracker without a login) takes back what that start made."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"conversations": [{"role": "user", "content": "hi"}]}) + "\n")
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "fresh"), "--set",
                f"data.paths=[{data}]")
    assert p.returncode == 3 and "d.jsonl:1 (no assistant tokens)" in p.stderr, p.stderr
    assert "building the tiny target" not in p.stdout
    assert sorted(x.name for x in (tmp_path / "fresh").iterdir()) == ["bad_lines.txt"]
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "taps"), "--set",
                f"model.target={tiny_target_dir}", "--set", "model.num_draft_layers=5")
    assert p.returncode == 2 and "the default tap spacing for 6 target layers" in p.stderr, p.stderr
    assert not (tmp_path / "taps").exists()
    mine = tmp_path / "mine"  # a directory as dflash-ops launches the trainer in it (a fresh start takes no other)
    mine.mkdir()
    (mine / "run.json").write_text("keep me")
    (mine / "output.log").write_text("and me")
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(mine), "--set", "model.num_draft_layers=5")
    assert p.returncode == 2 and "the default tap spacing for 6 target layers" in p.stderr, p.stderr
    assert "building the tiny target" not in p.stdout and "Traceback" not in p.stderr
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_OFFLINE", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(mine), "--set", "track.backends=[wandb]")
    assert p.returncode == 2 and "wandb could not start a run" in p.stderr, p.stderr[-3000:]
    assert "building the tiny target" in p.stdout
    assert sorted(x.name for x in mine.iterdir()) == ["output.log", "run.json"]  # its tiny target went, they stayed
    assert (mine / "run.json").read_text() == "keep me" and (mine / "output.log").read_text() == "and me"


def snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def error_lines(stderr):
    return [ln for ln in stderr.splitlines() if not ln.startswith("import time:")]


def _target_copy(tmp_path, tiny_target_dir):
    import shutil

    return shutil.copytree(tiny_target_dir, tmp_path / "ttcopy"), []


def _interrupted_run(tmp_path, tiny_target_dir):
    """Ctrl-C before the first checkpoint: the config and the first metrics records, no ckpt/."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"seed": 0}\n')
    (run / "metrics.jsonl").write_text('{"step": 10, "loss": 3.2}\n{"step": 20, "loss": 2.9}\n')
    return run, ["--set", f"model.target={tiny_target_dir}"]


def _an_export(tmp_path, tiny_target_dir):
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "config.json").write_text("{}\n")
    return run, ["--set", f"model.target={tiny_target_dir}"]


def _a_users_file(tmp_path, tiny_target_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("keep me")
    return run, ["--set", f"model.target={tiny_target_dir}"]


@pytest.mark.parametrize("setup, listed", [
    (_target_copy, None), (_interrupted_run, "config.json, metrics.jsonl"), (_an_export, "export"),
    (_a_users_file, "notes.txt")])
def test_a_fresh_start_refuses_a_run_dir_it_would_overwrite_before_torch(tmp_path, tiny_target_dir, setup, listed):
    """The run would overwrite config.json, append to metrics.jsonl and replace export/: a fresh start takes only an
    empty directory (or one as dflash-ops launches it). Here also the review's case: --run-dir = the target."""
    run, sets = setup(tmp_path, tiny_target_dir)
    if not sets:  # the target itself as the run directory
        sets = ["--set", f"model.target={run}"]
        names = sorted(x.name for x in run.iterdir())
        assert "config.json" in names and len(names) > 5
        listed = ", ".join(names[:5]) + f" and {len(names) - 5} more"
    before = snapshot(run)
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(run), *sets, flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    errors = error_lines(p.stderr)
    assert errors[0].startswith(f"error: {run} is not empty ({listed}") and errors[0].endswith(
        "): a fresh start would overwrite what is there"), errors
    assert errors[1:] == ["hint: use a new or empty --run-dir (it holds no checkpoint to --resume from)"]
    assert "torch" not in imported(p.stderr)
    assert snapshot(run) == before


def test_a_fresh_start_into_a_run_dir_as_dflash_ops_launches_it_is_not_refused(tmp_path, tiny_target_dir):
    """The runbooks start the trainer with --run-dir = the ops run dir, which already holds the launcher's files
    (run.json, the exit-status reserve, output.log, pid): launched through the real launch script, the trainer gets
    past the run-directory check and stops at the (deliberately bad) data, exit 3."""
    import time

    from dflash_ops.runs import launch_scripts
    from dflash_ops.spec import Liveness, RunSpec

    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    runs, rid = tmp_path / "runs", "smoke-20260101T000000-abcd"
    argv = (sys.executable, "-m", "trainer", "train", "--recipe", "smoke", "--run-dir", "{run_dir}", "--set",
            f"model.target={tiny_target_dir}", "--set", f"data.paths=[{bad}]")
    spec = RunSpec(run_id=rid, name="smoke", runbook="smoke", argv=tuple(a.replace("{run_dir}", str(runs / rid))
                                                                        for a in argv),
                   workdir=str(runs / rid), env=(("PYTHONPATH", str(REPO_ROOT)),), pre=(), runs_dir=str(runs),
                   host="local", ct=None, liveness=Liveness())
    launched = subprocess.run(["bash", "-c", launch_scripts.launch_script(spec)], capture_output=True, text=True)
    assert "DFLASH_LAUNCHED" in launched.stdout, launched
    deadline = time.monotonic() + 120
    while not (runs / rid / "exit_code").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = (runs / rid / "output.log").read_text()
    assert (runs / rid / "exit_code").read_text().strip() == "3", log
    assert "error: too many malformed lines" in log and "not empty" not in log
    assert (runs / rid / "run.json").is_file() and (runs / rid / "pid").is_file()


def test_a_rerun_after_ctrl_c_before_any_checkpoint_keeps_the_metrics(tmp_path, tiny_target_dir, finished_short_run):
    """The review's repro with the real trainer: a run stopped before its first checkpoint left config.json and
    metrics.jsonl; the same command again refused, the records are not doubled."""
    run = copy_of_short_run(finished_short_run, tmp_path / "run")
    import shutil

    shutil.rmtree(run / "ckpt")  # as if stopped before its first checkpoint
    shutil.rmtree(run / "export")
    records = (run / "metrics.jsonl").read_text()
    assert len(records.splitlines()) == 2
    p = run_cli(*short_argv(run, tiny_target_dir))
    assert p.returncode == 2 and f"error: {run} is not empty (config.json, data.json, metrics.jsonl)" in p.stderr, p.stderr
    assert (run / "metrics.jsonl").read_text() == records


def test_data_with_no_supervised_token_exits_3(tmp_path, tiny_target_dir):
    """Lines without a 1 in their loss_mask are malformed (found before torch); lines whose supervised tokens all
    lie past data.seq_len leave nothing to train: one line, exit 3, before any model is built."""
    unsupervised = tmp_path / "u.jsonl"
    unsupervised.write_text(json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 0, 0]}) + "\n")
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "u"), "--set",
                f"model.target={tiny_target_dir}", "--set", f"data.paths=[{unsupervised}]", flags=("-X", "importtime"))
    assert p.returncode == 3, p.stderr[-2000:]
    assert f"{unsupervised}:1 (no supervised token ('loss_mask' holds no 1))" in p.stderr
    assert "torch" not in imported(p.stderr)
    late = tmp_path / "late.jsonl"
    late.write_text("".join(json.dumps({"input_ids": list(range(3, 23)), "loss_mask": [0] * 16 + [1] * 4}) + "\n"
                            for _ in range(8)))
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "late"), "--set",
                f"model.target={tiny_target_dir}", "--set", f"data.paths=[{late}]", "--set", "data.seq_len=16",
                "--set", "data.num_anchors=4")
    assert p.returncode == 3, p.stderr[-2000:]
    assert p.stderr.splitlines()[0] == ("error: no supervised token left in the training data after packing (8 "
                                        "samples truncated to data.seq_len=16)"), p.stderr
    assert "loading the target" not in p.stdout and not (tmp_path / "late").exists()


def test_the_gpu_recipe_without_data_is_refused_in_one_line_before_torch(tmp_path, tiny_target_dir):
    """The gpu recipe has no data of its own: a forgotten data.paths must not train a real target on the toy set."""
    p = run_cli("train", "--recipe", "gpu", "--run-dir", str(tmp_path / "r"), "--set",
                f"model.target={tiny_target_dir}", flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert error_lines(p.stderr) == ["error: data.paths is empty: name the training JSONL files with "
                                     "--set 'data.paths=[...]'"]
    assert "torch" not in imported(p.stderr) and not (tmp_path / "r").exists()


@pytest.mark.parametrize("sets, message", [
    (["optim.eps=-1"], "error: optim.eps must be a finite number > 0, got -1.0"),
    (["optim.weight_decay=nan"], "error: optim.weight_decay must be a finite number >= 0, got nan"),
    (["model.block_size=300", "data.seq_len=128"], "error: model.block_size=300 does not fit in a row of "
                                                   "data.seq_len=128 tokens; use --set model.block_size=N with N <= "
                                                   "data.seq_len (or raise data.seq_len)"),
    (["seed=99999999999999999999999"], "error: seed must be in [0, 2**63), got 99999999999999999999999"),
    (["data.max_eval_rows=0"], "error: data.max_eval_rows must be >= 1, got 0"),
    (["model.target=["], "error: --set model.target: cannot parse value '[' as YAML: expected the node content, "
                         "but found '<stream end>' (line 1, column 2)"),
])
def test_config_values_torch_or_the_data_would_trip_on_are_refused_before_torch(tmp_path, tiny_target_dir, sets,
                                                                                 message):
    args = [x for s in [f"model.target={tiny_target_dir}", *sets] for x in ("--set", s)]
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), *args, flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert error_lines(p.stderr) == [message]
    assert "torch" not in imported(p.stderr) and not (tmp_path / "r").exists()


@pytest.mark.parametrize("where, resume", [("", False), ("", True), ("sub/run", False)])
def test_a_run_dir_that_is_or_lies_in_a_file_is_refused_before_torch(tmp_path, tiny_target_dir, where, resume):
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    run_dir = path / where if where else path
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(run_dir), "--set", f"model.target={tiny_target_dir}",
                *(["--resume"] if resume else []), flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    inside = "" if run_dir == path else f"inside {path}, which is "
    assert error_lines(p.stderr) == [f"error: --run-dir {run_dir} is {inside}an existing file, not a directory: "
                                     "choose another --run-dir"]
    assert "torch" not in imported(p.stderr) and path.read_text() == "keep me"


@pytest.mark.parametrize("sets, message", [
    (["model.target_layer_ids=[1, 6]"], "error: model.target_layer_ids gives [1, 6]; taps must be distinct, "
                                        "ascending and within 0..5"),
    (["model.mask_token_id=100000"], "error: mask token id 100000 (model.mask_token_id) is not a row of the target "
                                     "embedding (0..VOCAB)"),
])
def test_taps_and_a_mask_id_the_target_cannot_have_are_refused_before_torch(tmp_path, tiny_target_dir, sets, message):
    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    args = [x for s in [f"model.target={tiny_target_dir}", *sets] for x in ("--set", s)]
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(tmp_path / "r"), *args, flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert error_lines(p.stderr)[0] == message.replace("VOCAB", str(vocab - 1))
    assert "torch" not in imported(p.stderr) and not (tmp_path / "r").exists()


USAGE = "eval needs --run-dir D, or --drafter EXPORT_DIR --target T with --data F or --prompts FILE..."


@pytest.mark.parametrize("args, message", [
    (["--run-dir", "D", "--prompts", "p.jsonl", "--limit", "0"],
     f"eval takes one of --run-dir, --data and --prompts, not --run-dir and --prompts together: {USAGE}"),
    (["--run-dir", "D", "--limit", "5", "--engine", "hf"],
     "--limit, --engine apply only to eval --prompts, not to eval --run-dir"),
    (["--drafter", "X", "--target", "T", "--data", "f.jsonl", "--max-new", "9"],
     "--max-new applies only to eval --prompts, not to eval --data"),
    (["--run-dir", "D", "--target", "T"],
     "eval --run-dir evaluates the run's own export against the run's own target: drop --target, or evaluate an "
     "export with --drafter EXPORT_DIR --target T --data F"),
    (["--drafter", "X", "--data", "f.jsonl"],
     "eval --data needs --target: eval --drafter EXPORT_DIR --target T --data F"),
    (["--drafter", "X", "--target", "T", "--prompts", "p.jsonl", "--limit", "0"], "--limit must be >= 1, got 0"),
    (["--drafter", "X", "--target", "T", "--prompts", "p.jsonl", "--max-new", "1"],
     "--max-new must be >= 2 (the first new token is the target's alone: one drafts nothing to measure), got 1"),
    (["--target", "T"], USAGE),
    (["--run-dir", "D", "--max-bad-fraction", "0.5"],
     "--max-bad-fraction applies only to eval --data, not to eval --run-dir"),
    (["--drafter", "X", "--target", "T", "--data", "f.jsonl", "--max-bad-fraction", "2"],
     "--max-bad-fraction must be in [0, 1], got 2.0"),
])
def test_eval_refuses_flags_that_do_not_fit_in_one_line_before_torch(tmp_path, args, message):
    p = run_cli("eval", *args, cwd=tmp_path, flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert error_lines(p.stderr) == [f"error: {message}"]
    assert "torch" not in imported(p.stderr)


@pytest.mark.parametrize("where, message", [
    ("file", "error: {out} is a file, not a directory"),
    ("in-file", "error: {out}: {root}/file is a file, not a directory"),
    ("full", "error: {out} is not empty (config.json, notes.txt): make-tiny-target writes a new directory and "
             "overwrites nothing"),
])
def test_make_tiny_target_overwrites_nothing_and_refuses_a_file_in_one_line_before_torch(tmp_path, where, message):
    (tmp_path / "file").write_text("mine\n")
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text('{"mine": true}\n')
    (full / "notes.txt").write_text("mine\n")
    out = {"file": tmp_path / "file", "in-file": tmp_path / "file" / "t", "full": full}[where]
    p = run_cli("make-tiny-target", str(out), "--train-steps", "0", flags=("-X", "importtime"))
    errors = [x for x in p.stderr.splitlines() if not x.startswith("import time:")]
    assert p.returncode == 2 and errors[0] == message.format(out=out, root=tmp_path), p.stderr[-2000:]
    assert errors[1:] == ["hint: pass a new or empty OUT_DIR"] and "torch" not in imported(p.stderr)
    assert (tmp_path / "file").read_text() == "mine\n" and (full / "config.json").read_text() == '{"mine": true}\n'


@pytest.mark.slow
def test_make_tiny_target_writes_into_a_new_or_an_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "t"):
        p = run_cli("make-tiny-target", str(out), "--train-steps", "0", "--layers", "4")
        assert p.returncode == 0 and p.stdout.strip().endswith(f"tiny target written to {out}"), p.stderr[-2000:]
        assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4


@pytest.mark.slow
def test_the_cpu_recipe_trains_a_users_own_target_and_warns_when_the_data_is_less_than_one_step(tmp_path,
                                                                                                 tiny_target_dir):
    """`--recipe cpu` with the user's target and data (README: own target on a CPU). One conversation packs into one
    row of the two a step takes: the run says, in one line, that every step reuses it and nothing is held out."""
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"conversations": [{"role": "user", "content": "count from 1 to 3"},
                                                 {"role": "assistant", "content": "1 2 3 done"}]}) + "\n")
    p = run_cli("train", "--recipe", "cpu", "--run-dir", str(tmp_path / "r"), "--set", f"model.target={tiny_target_dir}",
                "--set", f"data.paths=[{one}]", "--set", "optim.max_steps=2", "--set", "log.every=1")
    assert p.returncode == 0, p.stderr[-3000:]
    warnings = [x for x in p.stderr.splitlines() if x.startswith("warning: the training data packs into")]
    assert warnings == ["warning: the training data packs into 1 row(s) of data.seq_len=1024 tokens, less than one "
                        "optimizer step's 2 (data.rows_per_step x optim.accum_steps x ranks): every step reuses the "
                        "same row(s), and 0 sample(s) are held out (no simulated tau); add data, or lower "
                        "data.seq_len / data.rows_per_step"]
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (cfg["device"], cfg["step"]["mode"], cfg["model"]["dtype"]) == ("cpu", "eager", "float32")


@pytest.mark.parametrize("text, message", [
    (b"model:\n  target: \xff\xfe\n", "error: recipe {recipe} is not UTF-8 text (byte 18: invalid start byte)"),
    (b"model:\n  target: [\n", "error: recipe {recipe} is not valid YAML: expected the node content, but found "
                               "'<stream end>' (line 3, column 1)"),
    (b"model:\n", "error: model must be a mapping, got None"),
    (None, "error: recipe {recipe} is a folder, not a recipe file"),
])
def test_a_broken_recipe_is_one_line_before_torch(tmp_path, text, message):
    recipe = tmp_path / "r.yaml"
    if text is None:
        recipe.mkdir()
    else:
        recipe.write_bytes(text)
    p = run_cli("train", "--recipe", str(recipe), "--run-dir", str(tmp_path / "r"), flags=("-X", "importtime"))
    assert p.returncode == 2, p.stderr[-2000:]
    assert [x for x in error_lines(p.stderr) if not x.startswith("hint:")] == [message.format(recipe=recipe)]
    assert "torch" not in imported(p.stderr) and not (tmp_path / "r").exists()


def _fake_export(root):
    """An export directory as far as the checks before torch read it."""
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}\n")
    (root / "model.safetensors").write_bytes(b"")
    return root


def _eval_export_case(tmp_path, tiny_target_dir, name):
    """-> (argv, exit code, first error line, hint line or None)."""
    from tests.trainer.test_regenerate import fake_target

    export = _fake_export(tmp_path / "export")
    smoke = str(REPO_ROOT / "trainer" / "assets" / "smoke.jsonl")
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    (tmp_path / "p.txt").write_text("count from 1 to 4\n")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")  # a run's config.json cut short
    no_weights = tmp_path / "export-only"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}\n")
    weightless = fake_target(tmp_path / "weightless", {"model_type": "qwen3", "num_hidden_layers": 6}, weights=False)
    base = fake_target(tmp_path / "base", {"model_type": "qwen3", "num_hidden_layers": 2}, template=False)
    short = fake_target(tmp_path / "short", {"model_type": "qwen3", "max_position_embeddings": 64})
    nowhere = tmp_path / "nowhere"
    cut = "(JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
    cases = {
        "eval, no run dir": (["eval", "--run-dir", str(nowhere)], 2, f"error: --run-dir {nowhere} does not exist",
                             "hint: point --run-dir at a trainer run directory"),
        "eval, a run's config cut short": (["eval", "--run-dir", str(broken)], 2,
                                           f"error: cannot read {broken}/config.json {cut}",
                                           "hint: point --run-dir at a run directory this trainer wrote"),
        "export, no run dir": (["export", "--run-dir", str(nowhere)], 2, f"error: --run-dir {nowhere} does not exist",
                               "hint: point --run-dir at a trainer run directory"),
        "export, a run's config cut short": (["export", "--run-dir", str(broken)], 2,
                                             f"error: cannot read {broken}/config.json {cut}",
                                             "hint: point --run-dir at a run directory this trainer wrote"),
        "eval, no export": (["eval", "--drafter", str(nowhere), "--target", str(tiny_target_dir), "--data", smoke], 2,
                            f"error: {nowhere} has no config.json (it does not exist)",
                            "hint: point at a drafter export directory (config.json + model.safetensors)"),
        "eval, an export without weights": (["eval", "--drafter", str(no_weights), "--target", str(tiny_target_dir),
                                             "--data", smoke], 2,
                                            f"error: {no_weights} has config.json but no model.safetensors",
                                            "hint: point at a drafter export directory (config.json + "
                                            "model.safetensors)"),
        "eval --data, a target without weights": (["eval", "--drafter", str(export), "--target", str(weightless),
                                                   "--data", smoke], 2,
                                                  f"error: target {weightless}: no weights (model.safetensors or "
                                                  "pytorch_model.bin, or their .index.json)", None),
        "eval --prompts, a target without weights": (["eval", "--drafter", str(export), "--target", str(weightless),
                                                      "--prompts", str(tmp_path / "p.txt")], 2,
                                                     f"error: target {weightless}: no weights", None),
        "eval --prompts, a target without a chat template": (
            ["eval", "prompts", "--drafter", str(export), "--target", str(base), "--prompts", str(tmp_path / "p.txt")],
            2, f"error: target {base} has no chat template: eval prompts renders each prompt with it",
            "hint: use a chat (instruct) target, or add a chat_template to its tokenizer_config.json"),
        "eval --prompts, --max-new past the target's positions": (
            ["eval", "prompts", "--drafter", str(export), "--target", str(short), "--prompts", str(tmp_path / "p.txt"),
             "--max-new", "64"], 2, "error: --max-new 64 leaves no room for a prompt in the target's 64 positions",
            "hint: pass --max-new below 64"),
        "eval --prompts, a directory as a prompt file": (
            ["eval", "prompts", "--drafter", str(export), "--target", str(tiny_target_dir), "--prompts",
             str(tmp_path)], 3, f"error: prompt file {tmp_path} is a directory, not a file",
            f"hint: pass the files in it: {tmp_path}/*.jsonl"),
        "eval --data, malformed lines": (["eval", "--drafter", str(export), "--target", str(tiny_target_dir), "--data",
                                          str(tmp_path / "bad.jsonl")], 3,
                                         "error: too many malformed lines (100.0% > --max-bad-fraction=0.01)",
                                         "hint: fix the lines or raise --max-bad-fraction"),
        "eval --data, no file": (["eval", "--drafter", str(export), "--target", str(tiny_target_dir), "--data",
                                  str(nowhere)], 3, f"error: data file not found: {nowhere}", "hint: check --data"),
    }
    return cases[name]


@pytest.mark.parametrize("name", ["eval, no run dir", "eval, a run's config cut short", "export, no run dir",
                                  "export, a run's config cut short", "eval, no export",
                                  "eval, an export without weights", "eval --data, a target without weights",
                                  "eval --prompts, a target without weights",
                                  "eval --prompts, a target without a chat template",
                                  "eval --prompts, --max-new past the target's positions",
                                  "eval --prompts, a directory as a prompt file", "eval --data, malformed lines",
                                  "eval --data, no file"])
def test_eval_and_export_refuse_their_inputs_in_one_line_before_torch(tmp_path, tiny_target_dir, name):
    """eval and export check the run's config.json, the export and the target directory (train's checks: weights,
    family, tokenizer) and the data before torch, and their hints name eval's own flags."""
    argv, code, first, hint = _eval_export_case(tmp_path, tiny_target_dir, name)
    p = run_cli(*argv, flags=("-X", "importtime"))
    errors = [x for x in error_lines(p.stderr)]
    assert p.returncode == code and errors[0].startswith(first), p.stderr[-2000:]
    assert errors[1:] == ([hint] if hint else errors[1:2]) and len(errors) <= 2, errors
    assert "torch" not in imported(p.stderr) and "Traceback" not in p.stderr


def _short_run(tmp_path, target, *sets, name="run"):
    """A 4-step CLI run with checkpoints at 2 and 4, then step 4 and the export taken away: a run stopped after
    its step-2 checkpoint, to resume or export."""
    import shutil

    run = tmp_path / name
    base = [f"model.target={target}", "optim.max_steps=4", "ckpt.every=2", "data.seq_len=96", "data.rows_per_step=2",
            "data.num_anchors=8", "eval_at_end=false", *sets]
    p = run_cli("train", "--recipe", "smoke", "--run-dir", str(run), *[x for s in base for x in ("--set", s)])
    assert p.returncode == 0, p.stderr[-3000:]
    shutil.rmtree(run / "ckpt" / "step_4")
    shutil.rmtree(run / "export")
    return run


@pytest.mark.slow
def test_export_of_a_newest_checkpoint_cut_short_is_one_line_naming_the_file(tmp_path, finished_short_run):
    import shutil

    run = copy_of_short_run(finished_short_run, tmp_path / "run")
    shutil.rmtree(run / "ckpt" / "step_4")  # stopped after its step-2 checkpoint, as _short_run leaves it
    shutil.rmtree(run / "export")
    weights = run / "ckpt" / "step_2" / "drafter.pt"
    weights.write_bytes(weights.read_bytes()[:100])  # a copy that stopped early
    p = run_cli("export", "--run-dir", str(run))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = error_lines(p.stderr)
    assert errors[0].startswith("error: export: the newest checkpoint's drafter.pt cannot be read (RuntimeError: ")
    assert errors[1:] == ["hint: move that step_N directory out of ckpt/ to export from the one before it"]
    assert not (run / "export").exists()


@pytest.mark.slow
def test_a_resume_takes_the_target_and_the_data_where_they_moved_when_they_are_the_same(tmp_path, tiny_target_dir):
    """A resume whose target or data moved may name where they are now: the same weights (data.json's fingerprint
    of the target) and the same file sizes are checked, and config.json then names the new places."""
    import shutil

    target, data = tmp_path / "target", tmp_path / "d.jsonl"
    shutil.copytree(tiny_target_dir, target)
    data.write_bytes(b"".join((REPO_ROOT / "trainer" / "assets" / "smoke.jsonl").read_bytes().splitlines(True)[:200]))
    run = _short_run(tmp_path, target, f"data.paths=[{data}]")
    size = data.stat().st_size
    moved_target, moved_data = target.rename(tmp_path / "target-moved"), data.rename(tmp_path / "moved.jsonl")

    p = run_cli("train", "--run-dir", str(run), "--resume")
    assert p.returncode == 2 and error_lines(p.stderr) == [
        f"error: --resume: the run's target {target} is not there (moved or removed since the run started)",
        "hint: resume with --set model.target=DIR: the same target where it is now (its config.json and weights are "
        "checked against the run's)"], p.stderr[-2000:]
    p = run_cli("train", "--run-dir", str(run), "--resume", "--set", f"model.target={moved_target}")
    assert p.returncode == 2 and error_lines(p.stderr)[0] == (
        f"error: --resume: data file missing since the run started: {data}, which had {size} bytes"), p.stderr
    assert "--set 'data.paths=[...]'" in error_lines(p.stderr)[1]

    other = shutil.copytree(moved_target, tmp_path / "other-weights")  # the same config.json, other weights
    weights = (other / "model.safetensors").read_bytes()
    (other / "model.safetensors").write_bytes(weights[:-1] + bytes([weights[-1] ^ 1]))
    p = run_cli("train", "--run-dir", str(run), "--resume", "--set", f"model.target={other}", "--set",
                f"data.paths=[{moved_data}]")
    assert p.returncode == 2 and error_lines(p.stderr)[0] == (
        f"error: --resume: the target {other} is not the one the run started with ({target}): its config.json or "
        "its weights differ"), p.stderr
    grown = tmp_path / "grown.jsonl"
    grown.write_bytes(moved_data.read_bytes() * 2)
    p = run_cli("train", "--run-dir", str(run), "--resume", "--set", f"model.target={moved_target}", "--set",
                f"data.paths=[{grown}]")
    assert p.returncode == 2 and error_lines(p.stderr)[0].startswith(
        f"error: --resume: data changed since the run started: {grown} (for {data}) ({size} -> {2 * size} bytes)")

    p = run_cli("train", "--run-dir", str(run), "--resume", "--set", f"model.target={moved_target}", "--set",
                f"data.paths=[{moved_data}]")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"the run's files moved: model.target ('{target}' -> '{moved_target}'); data.paths (['{data}'] -> " \
           f"['{moved_data}']) (config.json and data.json now say so)" in p.stdout
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["model"]["target"], cfg["data"]["paths"]) == (str(moved_target), [str(moved_data)])
    assert json.loads((run / "data.json").read_text())["files"] == {str(moved_data): size}
    assert run_cli("export", "--run-dir", str(run)).returncode == 0  # no --target: the run knows where it is now
    # another target (same config, other weights) is refused by export before torch, the export left as it was
    exported = (run / "export" / "config.json").read_bytes()
    p = run_cli("export", "--run-dir", str(run), "--target", str(other), flags=("-X", "importtime"))
    assert p.returncode == 2 and error_lines(p.stderr)[0] == (
        f"error: --target {other} is not the target the run trained with ({moved_target}): its config.json or its "
        "weights differ"), p.stderr[-2000:]
    assert "torch" not in imported(p.stderr) and (run / "export" / "config.json").read_bytes() == exported
    # eval run on data that changed since: its held-out split would not be the run's
    moved_data.write_bytes(moved_data.read_bytes() * 2)
    p = run_cli("eval", "run", "--run-dir", str(run))
    assert p.returncode == 2 and error_lines(p.stderr)[0].startswith(
        f"error: eval run: data changed since the run started: {moved_data} ({size} -> {2 * size} bytes); the "
        "held-out split would not be the run's"), p.stderr[-2000:]


def test_make_tiny_target_refuses_negative_steps_and_its_help_names_both_families(tmp_path):
    p = run_cli("make-tiny-target", str(tmp_path / "t"), "--train-steps", "-3", flags=("-X", "importtime"))
    assert p.returncode == 2 and error_lines(p.stderr) == [
        "error: --train-steps must be >= 0 (0 keeps the random weights), got -3"], p.stderr[-2000:]
    assert "torch" not in imported(p.stderr) and not (tmp_path / "t").exists()
    top = " ".join(run_cli("--help").stdout.split())
    assert "build and save a tiny Qwen3 or Llama 3 target + tokenizer" in top
    assert "--family llama: a Llama 3" in " ".join(run_cli("make-tiny-target", "--help").stdout.split())
