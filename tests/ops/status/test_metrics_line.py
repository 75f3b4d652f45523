"""The metrics-line contract (docs/contracts.md section 3), parsed from log text as the trainer prints it."""
import math

from dflash_ops.metrics_line import Metrics, Progress, latest, parse_metrics_line, parse_progress_line

LINE = ('DFLASH_METRICS {"step": 20, "epoch": 0, "loss": 3.41, "acc": 0.22, "acc_by_pos": [0.5, 0.1], '
        '"tokens_per_s": 51234.5, "lr": 0.0006, "step_time_s": 0.41, "elapsed_s": 9.8, "future_key": 1}')


def test_full_line():
    m = parse_metrics_line(LINE + "\n")
    assert m == Metrics(step=20, loss=3.41, acc=0.22, tokens_per_s=51234.5, lr=0.0006, epoch=0,
                        step_time_s=0.41, elapsed_s=9.8)
    assert "peak_mem_gib" not in m.as_dict() and m.as_dict()["step"] == 20


def test_required_keys_and_malformed_lines():
    assert parse_metrics_line('DFLASH_METRICS {"step": 3, "loss": 1}') == Metrics(step=3, loss=1.0)
    assert parse_metrics_line('DFLASH_METRICS {"loss": 1.0}') is None
    assert parse_metrics_line('DFLASH_METRICS {"step": true, "loss": 1.0}') is None
    assert parse_metrics_line('DFLASH_METRICS {"step": 3, "loss": 1.0') is None      # cut mid-write
    assert parse_metrics_line('step 20 loss 3.41 acc 0.22') is None                     # the human line
    assert parse_metrics_line('DFLASH_METRICS [1, 2]') is None


def test_nan_loss_is_kept_other_non_finite_values_dropped():
    m = parse_metrics_line('DFLASH_METRICS {"step": 5, "loss": NaN, "acc": Infinity}')
    assert math.isnan(m.loss) and m.acc is None


def test_non_finite_loss_spelled_as_a_string_as_the_trainer_writes_it():
    m = parse_metrics_line('DFLASH_METRICS {"step": 8, "loss": "nan", "acc": null, "total_steps": 10}')
    assert m.step == 8 and math.isnan(m.loss) and m.acc is None
    assert parse_metrics_line('DFLASH_METRICS {"step": 8, "loss": "high"}') is None


def test_prefix_after_carriage_return_progress_output():
    assert parse_metrics_line('\r 40%|####  DFLASH_METRICS {"step": 7, "loss": 2.0}').step == 7


def test_latest_skips_noise_and_marks_done():
    log = ["loading model", LINE, 'DFLASH_METRICS {"step": 40, "loss": 3.0}', "step 40 loss 3.0",
           'DFLASH_METRICS {"step": 60, "loss": 2.', ]
    assert latest(log).step == 40 and not latest(log).done
    assert latest(log + ['DFLASH_DONE {"step": 40}']).done
    assert latest(["nothing here"]) is None


PROGRESS = ('DFLASH_PROGRESS {"job": "regenerate", "done": 128, "total": 1000, "unit": "answers", "resumed": 28, '
            '"tokens": 51234, "tokens_per_s": 812.5, "elapsed_s": 63.1, "eta_s": 430.0, "future_key": 1}')


def test_progress_line_of_a_job_that_is_not_training():
    p = parse_progress_line(PROGRESS + "\n")
    assert p == Progress(job="regenerate", done=128, total=1000, unit="answers", tokens_per_s=812.5, elapsed_s=63.1,
                         eta_s=430.0)
    assert parse_progress_line('DFLASH_PROGRESS {"done": 3}') is None                        # no job
    assert parse_progress_line('DFLASH_PROGRESS {"job": "regenerate", "done": -1}') is None  # not a count
    assert parse_progress_line('DFLASH_PROGRESS {"job": "regenerate", "done": true}') is None
    assert parse_progress_line('DFLASH_PROGRESS {"job": "regenerate", "done": 3') is None     # cut mid-write
    assert parse_metrics_line(PROGRESS) is None and parse_progress_line(LINE) is None


def test_latest_is_the_last_line_of_either_kind_and_done_marks_it_finished():
    log = [LINE, PROGRESS, "regenerate 128/1000 answers"]
    assert latest(log) == parse_progress_line(PROGRESS) and not latest(log).finished
    assert latest(log + ['DFLASH_DONE {"job": "regenerate", "done": 1000, "total": 1000}']).finished
    assert isinstance(latest([PROGRESS, LINE]), Metrics)


def test_status_shows_a_progress_line_as_its_figures():
    from dflash_ops.cli.status_view import progress_figures

    p = parse_progress_line(PROGRESS)
    assert progress_figures(p) == ["regenerate 128/1000 answers", "tok/s 812", "eta 7m10s"]
    assert progress_figures(Progress(job="regenerate", done=9, total=9, finished=True)) == ["regenerate 9/9 done"]
