"""The stop's checkpoint, in process and without timing: a real SIGTERM (`signal.raise_signal`, handled by
trainer/signals.py's own handler) lands between two chosen steps, and the checkpoint the stop writes holds the
drafter and optimizer AFTER the step it reports -- bit for bit those of a run trained to that step without a stop
-- also when a ckpt.every checkpoint was written at an earlier step (the stop's is then the newest)."""
from __future__ import annotations

import json
import signal
import threading

import pytest
import torch

from tests.trainer.conftest import small_cfg

SETS = ("optim.max_steps=12", "log.every=2", "ckpt.every=3", "ckpt.keep=10")


def params_at(tiny_target_dir, run_dir, steps: int) -> dict[str, torch.Tensor]:
    """The drafter of an uninterrupted run of the same config after `steps` optimizer steps."""
    from trainer.build import build
    from trainer.loop import StopRule, TrainLoop

    session = build(small_cfg(tiny_target_dir, *SETS), run_dir)
    TrainLoop(session).run(StopRule(steps=steps))
    return {k: v.detach().clone() for k, v in session.state.drafter.state_dict().items()}


@pytest.mark.parametrize("signal_after, stop_step", [(3, 4), (4, 6), (1, 2)])
def test_the_stops_checkpoint_holds_the_step_it_reports_after_cadence_checkpoints(tiny_target_dir, tmp_path,
                                                                                   signal_after, stop_step):
    """signal_after 3: the cadence checkpoint of step 3 exists, the stop comes at log step 4. 4: the signal after
    log step 4 stops the run at log step 6, which is also a cadence step (one checkpoint, not two). 1: before any
    cadence checkpoint."""
    from trainer import checkpoint
    from trainer.build import build
    from trainer.loop import StopRule, TrainLoop
    from trainer.signals import stop_requests
    from trainer.train import finish

    run_dir = tmp_path / "stopped"
    session = build(small_cfg(tiny_target_dir, *SETS), run_dir)
    with stop_requests(quiet=True) as request:
        try:
            loop = TrainLoop(session, request)
            loop.run(StopRule(steps=signal_after))
            # handlers exist in the main thread only; elsewhere the SIGTERM below would end the test process
            assert threading.current_thread() is threading.main_thread()
            signal.raise_signal(signal.SIGTERM)  # the trainer's own handler records it
            assert request.signum == signal.SIGTERM
            ran = loop.run()
            result = finish(session, loop, ran, request)
        finally:
            request.release()  # this test process gets its handlers back
    assert ran.stopped_by == "signal" and result.step == stop_step and result.exit_code == 143
    assert result.checkpoint == run_dir / "ckpt" / f"step_{stop_step}" and result.export is None
    cadence = [s for s in range(3, stop_step + 1, 3)]
    assert [s for s, _ in checkpoint.list_checkpoints(run_dir)] == sorted(set(cadence + [stop_step]))
    assert checkpoint.newest_step(run_dir) == stop_step
    assert json.loads((result.checkpoint / "trainer.json").read_text())["step"] == stop_step

    saved = checkpoint.load_drafter(result.checkpoint)
    want = params_at(tiny_target_dir, tmp_path / "whole", stop_step)
    assert saved.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(saved[name], value), name  # bit for bit on the CPU
    before = params_at(tiny_target_dir, tmp_path / "before", stop_step - 1)
    assert any(not torch.equal(saved[n], before[n]) for n in want)  # the step's update is in it
