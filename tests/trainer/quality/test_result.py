"""quality/result.py: the pipeline's typed result serializes to quality.json's object, key for key and in order."""
import json

from trainer.quality.pretrain import PretrainResult
from trainer.quality.regenerate import RegenResult
from trainer.quality.result import DrafterResult, EvalResult, QualityResult, stage_record

PRE = PretrainResult(path="t", params=10, files_heldin=2, files_heldout=1, corpus_tokens=99, steps=3, tokens_seen=30,
                     final_loss=1.5, heldout_loss=1.7, seconds=2.0, stopped_by="steps")
REGEN = RegenResult(train_path="d/train.jsonl", eval_path="d/eval.jsonl", train_samples=4, eval_samples=2,
                    continuations=1, ended_with_eos=0.5, generated_tokens=40, seconds=1.0, stopped_by="done")
DRAFTED = DrafterResult(steps=5, total_steps=5, mode="eager", loss=2.0, acc=0.25, tokens_per_s=100.0, seconds=3.0,
                        planned_steps=6, stopped_by="budget", kind="dflash2", optim="muon")


def decode(dtype: str, tau: float) -> dict:
    return {"target_dtype": dtype, "tau": tau, "accept_by_pos": [0.9, 0.5], "speedup": 1.2, "identical": 2,
            "prompts": 2, "lossless": {"guaranteed": False, "unmet": ["x"]}, "repeated_4gram_frac": 0.1,
            "replayed_tau": tau, "target_tok_s": 10.0, "speculative_tok_s": 12.0, "engine": "static"}


def written_by_hand(ev: dict, timings: dict) -> dict:
    """quality.json's object as the pipeline spelled it as a dict literal: the reference the dataclass must meet."""
    return {"recipe": "quality_cpu", "reused_from": None, "device": "cpu", "torch": "2.x", "gpu": None,
            "target": PRE.__dict__, "regen": REGEN.__dict__, "drafter": DRAFTED.__dict__,
            "tau": ev["decode"]["tau"], "accept_by_pos": ev["decode"]["accept_by_pos"],
            "speedup": ev["decode"]["speedup"], "simulated_tau": ev["simulated"]["tau"],
            "replayed_tau": ev["decode"].get("replayed_tau"),
            "identical": f'{ev["decode"]["identical"]}/{ev["decode"]["prompts"]}',
            "lossless_by_construction": ev["decode"]["lossless"]["guaranteed"],
            "repeated_4gram_frac": ev["decode"]["repeated_4gram_frac"], "eval": ev,
            **({"also": {k: ev["decode_also"][k] for k in ("target_dtype", "tau", "speedup", "identical",
                                                            "target_tok_s", "speculative_tok_s")}}
               if "decode_also" in ev else {}),
            "timings_s": timings}


def test_quality_json_is_the_same_bytes_with_and_without_a_second_dtype():
    timings = {"pretrain": 1.0, "regenerate": 2.0, "drafter": 3.0, "eval": 4.0, "total": 10.0}
    simulated = {"tau": 1.4, "blocks": 3}
    for also in (None, decode("float32", 1.3)):
        ev = EvalResult(simulated=simulated, decode=decode("bfloat16", 1.5), decode_also=also)
        result = QualityResult(recipe="quality_cpu", reused_from=None, device="cpu", torch="2.x", gpu=None,
                               target=PRE, regen=REGEN, drafter=DRAFTED, eval=ev, timings_s=timings)
        by_hand = {"simulated": simulated, "decode": decode("bfloat16", 1.5), **({"decode_also": also} if also else {})}
        assert json.dumps(stage_record(ev)) == json.dumps(by_hand)  # stages.json's eval record
        expected = written_by_hand(by_hand, timings)
        assert json.dumps(result.to_dict(), indent=1) == json.dumps(expected, indent=1)
        assert (result.tau, result.identical, result.simulated_tau) == (1.5, "2/2", 1.4)


def test_a_stage_record_is_the_dataclass_s_fields_in_order():
    # The fields a run of the plain DFlash drafter always wrote keep their names and order; kind and optim follow.
    assert list(stage_record(DRAFTED)) == ["steps", "total_steps", "mode", "loss", "acc", "tokens_per_s", "seconds",
                                          "planned_steps", "stopped_by", "kind", "optim"]
    assert (stage_record(DRAFTED)["kind"], stage_record(DRAFTED)["optim"]) == ("dflash2", "muon")
    assert stage_record(PRE) == PRE.__dict__
