"""`dflash-ops resume`'s pure parts: the resumed run's spec (runbooks.resume_spec: the recorded command, `--resume`
for the trainer's `train`, the variables whose values run.json does not keep), where the trainer keeps its
checkpoints (runbooks.trainer_run_dir), and, run by bash here, how the scripts read a log that a resume appended
to: the probe from the new attempt's first byte, and a stop of an earlier attempt never taken for the last one's."""
from __future__ import annotations

import subprocess

import pytest

from dflash_ops import logview, wire
from dflash_ops.errors import UsageError
from dflash_ops.runs import launch_scripts, parse, read_scripts
from dflash_ops.runs.runbooks import resume_spec, trainer_run_dir
from dflash_ops.spec import Container, Host, Liveness, Runbook, Target

RUN_ID = "gw-20261203T101500-1a2b"
CT = Target(Host(name="pve1", transport="proxmox", address="10.1.2.6", env=(("HOST_VAR", "h"),)),
            Container(ctid="200", runs_dir="/runs", python="/venv/bin/python"))
BOOK = Runbook(name="graphwarm", command=("{python}", "-m", "trainer", "train", "--recipe", "r", "--run-dir",
                                          "{run_dir}"), env=(("BOOK_VAR", "{run_id}"),), pre=("clear_inductor_cache",),
               liveness=Liveness(wait_s=5, pattern="step ", timeout_s=300))
RECORDED = ["/old/python", "-m", "trainer", "train", "--recipe", "r", "--run-dir", f"/runs/{RUN_ID}", "--set", "a=1"]


def meta(**changed) -> dict:
    return {"run_id": RUN_ID, "name": "gw", "runbook": "graphwarm", "argv": RECORDED, "workdir": f"/runs/{RUN_ID}",
            "env_keys": ["HOST_VAR", "BOOK_VAR"], "host": "pve1", "ct": "200", "started_at": 1, **changed}


def test_a_trainer_run_resumes_with_its_recorded_command_and_the_runbooks_settings():
    spec = resume_spec(BOOK, CT, meta(), run_id=RUN_ID)
    assert spec.argv == (*RECORDED, "--resume")             # what ran, not the runbook as it reads now
    assert (spec.run_id, spec.name, spec.run_dir, spec.workdir) == (RUN_ID, "gw", f"/runs/{RUN_ID}", f"/runs/{RUN_ID}")
    assert dict(spec.env) == {"HOST_VAR": "h", "BOOK_VAR": RUN_ID}
    assert (spec.pre, spec.liveness) == (BOOK.pre, BOOK.liveness)
    again = resume_spec(BOOK, CT, meta(argv=[*RECORDED, "--resume"]), run_id=RUN_ID)
    assert again.argv.count("--resume") == 1
    job = resume_spec(BOOK, CT, meta(argv=["python3", "job.py", "--out", "x"]), run_id=RUN_ID)
    assert job.argv == ("python3", "job.py", "--out", "x")   # not the trainer's train: runs again as it was


def test_a_variable_whose_value_run_json_does_not_keep_must_be_given_again():
    with pytest.raises(UsageError) as e:
        resume_spec(BOOK, CT, meta(env_keys=["HOST_VAR", "BOOK_VAR", "WANDB_API_KEY"]), run_id=RUN_ID)
    assert "WANDB_API_KEY" in e.value.message and e.value.hint == "give it again: --env WANDB_API_KEY=..."
    spec = resume_spec(BOOK, CT, meta(env_keys=["WANDB_API_KEY"]), run_id=RUN_ID,
                       extra_env=(("WANDB_API_KEY", "k"),))
    assert dict(spec.env)["WANDB_API_KEY"] == "k"


@pytest.mark.parametrize("broken", [{"argv": None}, {"argv": []}, {"argv": [1]}, {"workdir": None},
                                    {"env_keys": "A"}])
def test_a_run_json_that_lacks_what_a_resume_needs_is_one_usage_error(broken):
    with pytest.raises(UsageError, match=f"run {RUN_ID} has no readable run.json"):
        resume_spec(BOOK, CT, meta(**broken), run_id=RUN_ID)


def test_the_trainers_run_dir_is_its_last_run_dir_as_the_job_reads_it():
    assert trainer_run_dir(tuple(RECORDED), "/w") == f"/runs/{RUN_ID}"
    assert trainer_run_dir(("p", "-m", "trainer", "train", "--run-dir", "a", "--run-dir=../b"), "/w/") == "/w/../b"
    assert trainer_run_dir(("p", "-m", "trainer", "train", "--run-dir", "~/r"), "/w") == "~/r"
    assert trainer_run_dir(("p", "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trainer", "train",
                            "--run-dir", "/r"), "/w") == "/r"
    assert trainer_run_dir(("p", "-m", "trainer", "regenerate", "--run-dir", "/r"), "/w") is None
    assert trainer_run_dir(("p", "-m", "trainer", "train", "--recipe", "smoke"), "/w") is None


def _bash(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True)


def test_the_probe_reads_the_log_from_the_new_attempts_first_byte(tmp_path):
    run = tmp_path / RUN_ID
    run.mkdir()
    (run / "output.log").write_bytes(b"step 1 of the first attempt\nDFLASH_RESUMED {}\nloading\n")
    since = len(b"step 1 of the first attempt\nDFLASH_RESUMED {}\n")
    probe = parse.probe(_bash(read_scripts.probe_script(str(run), since=since)).stdout)
    assert probe.log_tail == b"loading\n" and probe.raw.log_size == since + len(b"loading\n")
    assert parse.probe(_bash(read_scripts.probe_script(str(run), tail_bytes=4, since=0)).stdout).log_tail == b"step"


@pytest.mark.parametrize("log, kept", [
    (b'DFLASH_STOPPED {"step": 7}\nDFLASH_RESUMED {"attempt": 2, "at": 1}\nTraceback\n', {}),
    (b'DFLASH_STOPPED {"step": 7}\nDFLASH_RESUMED {"attempt": 2, "at": 1}\nDFLASH_STOPPED {"step": 9}\n',
     {RUN_ID: 9}),
    (b'DFLASH_STOPPED {"step": 7}\n', {RUN_ID: 7}),
])
def test_a_stop_before_a_resume_is_the_earlier_attempts_and_not_the_last_ones(tmp_path, log, kept):
    run = tmp_path / RUN_ID
    run.mkdir()
    (run / "output.log").write_bytes(log)
    (run / "exit_code").write_text(f"{wire.EXIT_LAUNCHER_STOPPED}\n")  # exit 1: a crash reads so too
    assert parse.kept_steps(_bash(read_scripts.kept_script(str(run))).stdout.decode()) == kept


def test_the_resume_script_is_valid_bash_and_its_checkpoint_check_quotes_the_path():
    spec = resume_spec(BOOK, CT, meta(), run_id=RUN_ID)
    script = launch_scripts.resume_script(spec, probe_after_s=1.0, checkpoints="/r/it's $(id)")
    done = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "for c in '/r/it'\"'\"'s $(id)'/ckpt/step_*; do" in script
    assert script.index("DFLASH_REFUSED running") < script.index("nockpt") < script.index("nohup")


def test_tail_says_a_resume_in_words():
    assert logview.human_line(b'DFLASH_RESUMED {"attempt": 2, "at": 1}\n') == b"resumed: attempt 2\n"
    assert logview.human_line(b"DFLASH_RESUMED {bad\n") == b"DFLASH_RESUMED {bad\n"
