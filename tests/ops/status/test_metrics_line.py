"""The metrics-line contract (docs/contracts.md section 3), parsed from log text as the trainer prints it."""
import math

from dflash_ops.metrics_line import Metrics, latest, parse_metrics_line

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
