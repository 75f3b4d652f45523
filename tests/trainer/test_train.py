import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import small_cfg
from trainer import checkpoint
from trainer.errors import NonFiniteLoss
from trainer.build import build
from trainer.loop import StopRule, TrainLoop
from trainer.train import finish


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_overfit_loss_falls_clearly(tmp_path, tiny_target_dir):
    cfg = small_cfg(tiny_target_dir, "optim.max_steps=40", "log.every=5", "optim.lr=3e-3", "optim.warmup_ratio=0.05",
                    "data.rows_per_step=4", "data.num_anchors=16")
    TrainLoop(build(cfg, tmp_path / "run")).run()
    got = losses(tmp_path / "run")
    assert got[40] < 0.7 * got[5], got


def logged_steps(run_dir):
    return [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run_and_logs_each_step_once(tmp_path, tiny_target_dir):
    sets = ("optim.max_steps=8", "ckpt.every=4", "optim.accum_steps=2", "data.rows_per_step=2")
    full = build(small_cfg(tiny_target_dir, *sets), tmp_path / "full")
    TrainLoop(full).run()
    first = build(small_cfg(tiny_target_dir, *sets), tmp_path / "split")
    TrainLoop(first).run(StopRule(steps=6))  # killed after step 6: steps 5 and 6 are logged, not checkpointed
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "split")] == [4]
    with (tmp_path / "split" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')  # and torn in the middle of a record
    del first
    torch.manual_seed(12345)  # resume must not depend on the process's RNG state
    second = build(small_cfg(tiny_target_dir, *sets), tmp_path / "split", resume=True)
    assert second.start.step == 4 and second.start.micro == 8
    kept = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in kept[:6]] == [1, 2, 3, 4, 5, 6]  # nothing dropped before training goes on
    TrainLoop(second).run()
    assert logged_steps(tmp_path / "split") == logged_steps(tmp_path / "full") == list(range(1, 9))
    a, b = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert [b[s] for s in range(1, 9)] == [a[s] for s in range(1, 9)]  # bit-exact on CPU
    pa = dict(full.state.drafter.named_parameters())
    for name, p in second.state.drafter.named_parameters():
        assert torch.equal(p, pa[name]), name


def test_resume_refuses_a_changed_config(tmp_path, tiny_target_dir):
    from trainer.errors import ConfigError

    TrainLoop(build(small_cfg(tiny_target_dir, "ckpt.every=2", "optim.max_steps=2"), tmp_path / "r")).run()
    with pytest.raises(ConfigError, match=r"optim.lr \(0.003 -> 0.001\)"):
        build(small_cfg(tiny_target_dir, "ckpt.every=2", "optim.max_steps=2", "optim.lr=1e-3"), tmp_path / "r",
              resume=True)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        build(small_cfg(tiny_target_dir, "ckpt.every=2", "optim.max_steps=2"), tmp_path / "r")


def test_a_resume_may_change_how_it_logs_and_checkpoints_but_not_what_it_trains(tmp_path, tiny_target_dir):
    from trainer.errors import ConfigError

    TrainLoop(build(small_cfg(tiny_target_dir, "ckpt.every=2", "optim.max_steps=4"), tmp_path / "r")).run(
        StopRule(steps=2))
    changed = ("ckpt.every=1", "ckpt.keep=5", "log.every=1", "threads=1", "eval_at_end=false")
    session = build(small_cfg(tiny_target_dir, "optim.max_steps=4", *changed), tmp_path / "r", resume=True)
    assert (session.cfg.ckpt.every, session.cfg.ckpt.keep, session.cfg.log.every) == (1, 5, 1)
    with pytest.raises(ConfigError, match=r"optim.max_steps \(4 -> 6\)") as e:
        build(small_cfg(tiny_target_dir, "ckpt.every=2", "optim.max_steps=6"), tmp_path / "r", resume=True)
    assert "only log.every, ckpt.every, ckpt.keep, threads, eval_at_end may change" in e.value.hint


def test_export_of_a_run_whose_target_moved_takes_the_target_where_it_is_now(tmp_path, tiny_target_dir):

    from trainer.errors import ConfigError
    from trainer.train import export_run

    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    TrainLoop(build(small_cfg(str(target), "ckpt.every=2", "optim.max_steps=2"), tmp_path / "r")).run()
    moved = tmp_path / "moved"
    target.rename(moved)
    with pytest.raises(ConfigError, match=rf"the run's target {target} is not there") as e:
        export_run(tmp_path / "r")
    assert "--target" in e.value.hint
    out = export_run(tmp_path / "r", str(moved))
    assert (out / "model.safetensors").is_file()
    with pytest.raises(ConfigError, match="does not exist"):
        export_run(tmp_path / "r", str(tmp_path / "nowhere"))


def test_a_checkpoint_copied_out_of_its_run_keeps_its_config(tmp_path, tiny_target_dir):
    """`dflash-ops pull --what ckpt` brings step_N/ without the run's config.json: each step carries a copy, so a
    resume there is checked against it and the export knows the run's shape."""

    from trainer.errors import ConfigError
    from trainer.train import export_run

    cfg = small_cfg(tiny_target_dir, "ckpt.every=2", "optim.max_steps=4")
    TrainLoop(build(cfg, tmp_path / "r")).run(StopRule(steps=2))
    step = checkpoint.list_checkpoints(tmp_path / "r")[-1][1]
    assert json.loads((step / "config.json").read_text()) == json.loads((tmp_path / "r" / "config.json").read_text())
    pulled = tmp_path / "pulled"
    shutil.copytree(step, pulled / "ckpt" / step.name)
    with pytest.raises(ConfigError, match=r"--resume with a different config: optim.lr"):
        build(small_cfg(tiny_target_dir, "ckpt.every=2", "optim.max_steps=4", "optim.lr=0.5"), pulled, resume=True)
    assert (export_run(pulled) / "model.safetensors").is_file()


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, tiny_target_dir):
    run = build(small_cfg(tiny_target_dir, "optim.max_steps=8", "ckpt.every=2", "log.every=4"), tmp_path / "r")
    loop = TrainLoop(run)
    ran = loop.run(StopRule(steps=4))
    saved = checkpoint.list_checkpoints(tmp_path / "r")
    assert [s for s, _ in saved] == [2, 4]
    good = torch.load(saved[-1][1] / "drafter.pt")
    with torch.no_grad():
        run.state.drafter.fc.weight.fill_(float("nan"))  # poison: the next loss is NaN
    with pytest.raises(NonFiniteLoss, match=r"Last good checkpoint: .*step_4"):
        loop.run()
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "r")] == [2, 4]
    after = torch.load(saved[-1][1] / "drafter.pt")
    assert all(torch.equal(good[k], after[k]) for k in good)
    with pytest.raises(NonFiniteLoss):
        finish(run, loop, ran)
    assert not (tmp_path / "r" / "export").exists()


def test_weights_broken_after_a_finite_loss_are_neither_checkpointed_nor_exported(tmp_path, tiny_target_dir):
    """An update can make the weights NaN after a finite loss (an inf gradient with clipping off): the loss check
    alone would checkpoint them and export a NaN drafter with exit 0."""
    from trainer.train import export_run

    run = build(small_cfg(tiny_target_dir, "optim.max_steps=8", "ckpt.every=2", "log.every=4"), tmp_path / "r")
    loop = TrainLoop(run)
    ran = loop.run(StopRule(steps=4))
    with torch.no_grad():
        run.state.drafter.fc.weight[0, 0] = float("inf")  # as a last update would leave it: the losses were finite
    with pytest.raises(NonFiniteLoss, match=r"non-finite drafter weights .* by step 4.*Last good checkpoint: .*step_4"):
        finish(run, loop, ran)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "r")] == [2, 4]
    assert not (tmp_path / "r" / "export").exists()
    newest = checkpoint.list_checkpoints(tmp_path / "r")[-1][1]
    weights = torch.load(newest / "drafter.pt")
    weights["fc.weight"][0, 0] = float("nan")  # a checkpoint written before this check existed
    torch.save(weights, newest / "drafter.pt")
    with pytest.raises(NonFiniteLoss, match="holds non-finite"):
        export_run(tmp_path / "r")
    assert not (tmp_path / "r" / "export").exists()


def test_a_damaged_newest_checkpoint_is_one_line_naming_the_file(tmp_path, tiny_target_dir):
    from trainer.errors import ConfigError

    cfg = small_cfg(tiny_target_dir, "ckpt.every=2", "optim.max_steps=4")
    TrainLoop(build(cfg, tmp_path / "r")).run()
    newest = checkpoint.list_checkpoints(tmp_path / "r")[-1][1]
    whole = (newest / "optimizer.pt").read_bytes()
    (newest / "optimizer.pt").write_bytes(whole[: len(whole) // 2])  # a copy or a disk that stopped half-way
    with pytest.raises(ConfigError, match=r"newest checkpoint's optimizer.pt cannot be read") as e:
        build(cfg, tmp_path / "r", resume=True)
    assert "move that step_N directory out of ckpt/" in e.value.hint
    (newest / "trainer.json").write_text("{")
    with pytest.raises(ConfigError, match=r"trainer.json cannot be read"):
        build(cfg, tmp_path / "r", resume=True)


def test_a_resume_of_a_run_stopped_before_its_first_checkpoint_says_how_out(tmp_path, tiny_target_dir):
    from trainer.errors import ConfigError

    cfg = small_cfg(tiny_target_dir, "ckpt.every=100", "optim.max_steps=4")
    run = build(cfg, tmp_path / "r")
    TrainLoop(run).run(StopRule(steps=2))  # as if stopped by Ctrl-C: config.json and metrics.jsonl, no checkpoint
    with pytest.raises(ConfigError, match=r"stopped before its first, at ckpt.every=100 steps") as e:
        build(cfg, tmp_path / "r", resume=True)
    assert e.value.hint == f"start afresh in a new --run-dir, or remove {tmp_path / 'r'} first"
    with pytest.raises(ConfigError, match="is not empty"):
        build(cfg, tmp_path / "r")


def test_a_resume_over_data_that_grew_is_refused_and_one_over_the_same_data_goes_on(tmp_path, tiny_target_dir):
    from trainer.errors import ConfigError
    from trainer.data.source import resolve_path

    data = tmp_path / "d.jsonl"
    lines = resolve_path("bundled:smoke.jsonl").read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:150]))
    cfg = small_cfg(tiny_target_dir, "ckpt.every=2", "optim.max_steps=4", f"data.paths=[{data}]")
    TrainLoop(build(cfg, tmp_path / "r")).run(StopRule(steps=2))
    record = json.loads((tmp_path / "r" / "data.json").read_text())
    assert record["files"] == {str(data): data.stat().st_size}
    assert set(record["target"]) == {"config_sha256", "weights_fingerprint"}  # which target: a moved one is checked
    build(cfg, tmp_path / "r", resume=True)  # the same files: it goes on
    before = data.stat().st_size
    data.write_text("".join(lines[:300]))  # a regenerate still appending
    with pytest.raises(ConfigError, match=rf"data changed since the run started: {data} \({before} -> "):
        build(cfg, tmp_path / "r", resume=True)


def test_checkpoints_are_atomic_and_pruned_to_keep(tmp_path, target):
    from tests.trainer.conftest import make_state

    state = make_state(target)
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, checkpoint.Cursor(step=step, micro=2 * step), state.drafter, state.optimizer, keep=2)
    (tmp_path / "ckpt" / "step_9.tmp").mkdir()  # a save that crashed half-way
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_3", "step_4", "step_9.tmp"]
    cursor = checkpoint.load_latest(tmp_path, state.drafter, state.optimizer, state.lr_)
    assert cursor == checkpoint.Cursor(step=4, micro=8)
    assert all(g["lr"] is state.lr_ for g in state.optimizer.param_groups)  # the schedule's tensor, still bound


def test_a_prune_cut_short_never_leaves_a_torn_checkpoint_listed(tmp_path, target, monkeypatch):
    """A kill while the oldest checkpoint is deleted (rmtree goes file by file) must not leave a step_N that lists as
    complete: the prune renames it out of the step_N names first, and a listed step has every file."""
    from tests.trainer.conftest import make_state

    state = make_state(target)
    for step in (1, 2):
        checkpoint.save(tmp_path, checkpoint.Cursor(step=step, micro=step), state.drafter, state.optimizer, keep=2)
    (tmp_path / "ckpt" / "step_1" / "drafter.pt").unlink()  # a delete cut short, as rmtree leaves it
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2]
    shutil.rmtree(tmp_path / "ckpt" / "step_1")

    def killed(path, ignore_errors=False):  # the kill lands inside the delete of a checkpoint
        if not path.exists():
            return
        (path / "drafter.pt").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, checkpoint.Cursor(step=3, micro=3), state.drafter, state.optimizer, keep=1)
    monkeypatch.undo()
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [3]
    checkpoint.save(tmp_path, checkpoint.Cursor(step=4, micro=4), state.drafter, state.optimizer, keep=1)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_4"]  # the leftovers swept
    # the same position again (a stop at a checkpoint step) leaves the copy there untouched: no moment without one
    inode = (tmp_path / "ckpt" / "step_4" / "drafter.pt").stat().st_ino
    checkpoint.save(tmp_path, checkpoint.Cursor(step=4, micro=4), state.drafter, state.optimizer, keep=1)
    assert (tmp_path / "ckpt" / "step_4" / "drafter.pt").stat().st_ino == inode


def test_evaluation_of_a_flex_run_uses_the_dense_reference_mask(tmp_path, tiny_target_dir):
    """A run trained with step.attn=flex (CUDA only) is evaluated with the sdpa block mask: the flex backend needs
    the training step's static mask buffers, which evaluation does not have (this crashed the first H200 quality
    run after training). Here: a CPU run whose recorded config says flex, as a GPU run's would."""
    from trainer.eval import evaluate_run

    cfg = small_cfg(tiny_target_dir, "optim.max_steps=2", "data.rows_per_step=2", "eval_at_end=false")
    run = build(cfg, tmp_path / "run")
    loop = TrainLoop(run)
    finish(run, loop, loop.run())
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    config["step"]["attn"] = "flex"
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    result = evaluate_run(tmp_path / "run", rows=run.datasets.eval)
    assert result["blocks"] > 0 and 1.0 <= result["tau"] <= cfg.model.block_size


def test_dropping_the_records_after_a_checkpoint_keeps_every_earlier_line(tmp_path):
    from trainer.metrics import drop_records_after

    log = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)] + ["not a record"] + \
        [json.dumps({"step": s, "loss": 1.0}) for s in (5, 6)]
    log.write_text("\n".join(lines) + "\n" + '{"step": 7, "lo')
    assert drop_records_after(log, 4) == 3
    assert log.read_text() == "\n".join(lines[:5]) + "\n"
    assert drop_records_after(log, 4) == 0 and not (tmp_path / "metrics.jsonl.tmp").exists()
    assert drop_records_after(tmp_path / "none.jsonl", 4) == 0 and not (tmp_path / "none.jsonl").exists()


def test_an_empty_target_is_refused_unless_the_config_allows_the_tiny_one(tmp_path, tiny_target_dir):
    from trainer.config import load_config
    from trainer.errors import ConfigError

    gpu_on_cpu = load_config("gpu", ["device=cpu", "step.attn=sdpa", "step.mode=eager"])
    assert not gpu_on_cpu.model.allow_tiny_target and load_config("smoke").model.allow_tiny_target
    with pytest.raises(ConfigError, match=r"^model.target is empty: set model.target=DIR"):
        build(gpu_on_cpu, tmp_path / "r")
    with pytest.raises(ConfigError, match="model.target is empty"):
        build(load_config("smoke", ["model.allow_tiny_target=false"]), tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_a_resume_of_a_run_recorded_before_a_config_key_existed_is_not_refused(tmp_path, tiny_target_dir):
    from trainer import rundir

    cfg = small_cfg(tiny_target_dir, "ckpt.every=2", "optim.max_steps=2")
    TrainLoop(build(cfg, tmp_path / "r")).run()
    recorded = json.loads((tmp_path / "r" / "config.json").read_text())
    del recorded["model"]["allow_tiny_target"]  # as an older trainer wrote it
    (tmp_path / "r" / "config.json").write_text(json.dumps(recorded))
    rundir.check_start(cfg, tmp_path / "r", resume=True)
    assert rundir.config_diff(recorded, {**recorded, "seed": 1}) == ["seed (0 -> 1)"]


def test_a_budgeted_horizon_follows_the_measured_rate_both_ways():
    from trainer.loop import fitting_horizon

    # 100 steps done in 10 s of a 60 s budget, measured at 10 steps/s: 500 more fit.
    assert fitting_horizon(100, 10.0, 50, 5.0, 60.0, end=10_000) == 600
    # The rate doubles later on: the horizon grows again (a shrink-only horizon kept the early, slower estimate).
    assert fitting_horizon(200, 20.0, 100, 5.0, 60.0, end=10_000) == 200 + 800
    # Never past the planned end, never fewer than one more step, and the budget spent means one more step.
    assert fitting_horizon(100, 10.0, 50, 5.0, 1e9, end=1_000) == 1_000
    assert fitting_horizon(100, 70.0, 50, 5.0, 60.0, end=10_000) == 101
    assert fitting_horizon(100, 10.0, 0, 0.0, 60.0, end=900) == 900  # nothing measured yet: the plan stands


def test_the_closing_line_says_when_the_eval_ran_but_found_no_block(tmp_path, tiny_target_dir):
    """Held-out lines with no two consecutive supervised tokens: the eval runs and finds 0 blocks. The closing line
    says so, not that the eval was switched off or had no data."""
    import io

    from trainer.metrics import done_line

    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"input_ids": list(range(3, 11)), "loss_mask": [0, 1] * 4}) + "\n"
                            for _ in range(4)))
    out = io.StringIO()
    run = build(small_cfg(tiny_target_dir, "optim.max_steps=1", "eval_at_end=true", f"data.eval_paths=[{held}]"),
                tmp_path / "r", stream=out)
    loop = TrainLoop(run)
    result = finish(run, loop, loop.run())
    assert result.eval["blocks"] == 0 and result.tau is None and result.export == tmp_path / "r" / "export"
    last = next(ln for ln in out.getvalue().splitlines() if ln.startswith("run finished after "))
    assert last.endswith("no simulated tau: the held-out rows hold no block to evaluate (0 blocks: no two consecutive "
                         "supervised tokens; check data.eval_paths / data.eval_fraction)"), last
    assert "eval_at_end=false" in done_line({"step": 1, "run_dir": "R"})  # never evaluated: that wording stays


def test_the_resume_command_pastes_anywhere(tmp_path, monkeypatch):
    """The interpreter that ran the trainer and the run directory as absolute paths; torchrun's form keeps the ranks."""
    import shlex
    import sys

    from trainer import resumeline

    monkeypatch.chdir(tmp_path)
    argv = shlex.split(resumeline.resume_command(Path("runs/a b"), python="/opt/py 3/bin/python"))
    assert argv == ["/opt/py 3/bin/python", "-m", "trainer", "train", "--run-dir", str(tmp_path / "runs" / "a b"),
                    "--resume"]
    assert shlex.split(resumeline.resume_command(Path("r"), world=4))[:6] == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
