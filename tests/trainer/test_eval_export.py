import types

import pytest
import torch

from tests.trainer.conftest import make_state
from tests.trainer.test_traps import drafter_hidden, two_doc_batch
from trainer.decode.rounds import capped_rounds, leading_matches
from trainer.eval import block_acceptance, drafted_tokens, eval_chunks, replayed_rounds
from trainer.export import ExportConfig, export_drafter, load_exported
from trainer.model.target import packed_causal_mask
from trainer.step.step import forward_backward, optimizer_step


def test_leading_matches_counts_only_the_unbroken_prefix():
    ref = torch.tensor([[9, 1, 2, 3, 4]])
    valid = torch.tensor([[False, True, True, True, True]])
    assert leading_matches(torch.tensor([[0, 1, 2, 3, 4]]), ref, valid).tolist() == [4]
    assert leading_matches(torch.tensor([[0, 1, 7, 3, 4]]), ref, valid).tolist() == [1]  # later matches do not count
    assert leading_matches(torch.tensor([[0, 5, 2, 3, 4]]), ref, valid).tolist() == [0]
    stop = torch.tensor([[False, True, True, False, True]])
    assert leading_matches(torch.tensor([[0, 1, 2, 3, 4]]), ref, stop).tolist() == [2]  # left the document


class OracleDrafter(torch.nn.Module):
    """Returns the target's own last hidden state at anchor+k-1: its LM-head argmax IS the target's greedy token."""

    def __init__(self, target, batch):
        super().__init__()
        # What evaluation reads of a drafter's config: no sliding layers, and a head count for its chunking.
        self.cfg = types.SimpleNamespace(window=None, num_attention_heads=1)
        self.last = target.model.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                       attention_mask=packed_causal_mask(batch.doc_ids)).last_hidden_state

    def forward(self, feats, noise, layout):
        B, S = layout.block_size, self.last.shape[1]
        prev = (layout.anchor_pos[:, :, None] + torch.arange(B) - 1).clamp(0, S - 1).flatten(1)
        return self.last.gather(1, prev[:, :, None].expand(-1, -1, self.last.shape[2]))


def test_capped_rounds_stop_at_the_answers_end():
    # 10-token answer: rounds anchored at tokens 0, 1, 5; the last one drafted 15 but only 4 tokens were left.
    assert capped_rounds([0, 3, 15], 10) == [0, 3, 4]
    assert capped_rounds([], 10) == []


def test_replay_walks_rounds_like_decoding(full_target):
    """Rounds move on by accepted + 1 from the answer's first token (the prefill's) until the answer is made: the
    last round starts before the answer's last token and reaches it."""
    from tests.trainer.decode.test_reference import _drafter, _prompt_ids
    from trainer.decode.reference import generate_target_only

    ids = _prompt_ids(full_target, "count from 3 to 40")
    answer = generate_target_only(full_target, ids, 12)
    rounds = replayed_rounds(full_target, _drafter(full_target, seed=7), ids, answer, 4)
    assert rounds and all(0 <= a <= 3 for a in rounds)
    made = [sum(a + 1 for a in rounds[:k]) for k in range(len(rounds) + 1)]  # answer index each round starts at
    assert made[-2] < len(answer) - 1 <= made[-1]
    assert replayed_rounds(full_target, _drafter(full_target), ids, [], 4) == []


def test_perfect_drafter_gets_full_acceptance_and_tau_counts_the_bonus(full_target):
    batch = two_doc_batch()
    with torch.no_grad():
        accepted, valid = block_acceptance(full_target, OracleDrafter(full_target, batch), batch, 4)
    assert valid.tolist() == [[True] * 4 + [False]]
    assert accepted[0, :4].tolist() == [3, 3, 3, 3]  # every block: all B-1 drafted tokens accepted -> tau = B
    with torch.no_grad():
        none, _ = block_acceptance(full_target, make_state(full_target, block_size=4).drafter, batch, 4)
    assert none[0, :4].tolist() != [3, 3, 3, 3]


@pytest.mark.parametrize("rows,anchors,seq,heads,vocab,budget", [
    (4, 1024, 2048, 16, 151_936, 1 << 28),  # the quality recipe at 1,024 anchors: 72 GiB in one call before
    (4, 512, 3072, 32, 151_936, 1 << 28),
    (4, 8, 64, 4, 1000, 1 << 28),           # small rows: every row in one call
    (2, 5, 40, 2, 40, 1),                   # nothing fits: one anchor of one row per call
])
def test_eval_chunks_are_the_largest_pieces_that_fit_the_budget(rows, anchors, seq, heads, vocab, budget):
    B = 16

    def cost(r, n):
        return r * n * B * (heads * (seq + n * B) + vocab)

    r, n = eval_chunks(rows, anchors, seq, B, heads, vocab, budget)
    assert 1 <= r <= rows and 1 <= n <= anchors
    assert cost(r, n) <= budget or (r, n) == (1, 1)
    if n < anchors:
        assert r == 1 and cost(1, n + 1) > budget  # one more anchor would not fit
    elif r < rows:
        assert cost(r + 1, n) > budget


def test_the_drafter_sees_each_block_apart_so_evaluation_may_split_the_anchors(target):
    """What evaluating a few anchors at a time rests on: a block's output depends on its own context and block
    only, so the outputs of a subset of anchors equal those rows of the whole batch's output."""
    from trainer.model.attention import make_layout
    from trainer.model.loss import block_input_ids

    state = make_state(target, block_size=4, seed=3)
    batch = two_doc_batch()
    whole = drafter_hidden(state, batch)  # [N, B, D]
    feats = target.features(batch.input_ids, batch.position_ids, batch.doc_ids)
    for keep in ([2], [0, 3], [1, 2, 4]):
        ap, av = batch.anchor_pos[:, keep], batch.anchor_valid[:, keep]
        noise = target.embed_tokens(block_input_ids(batch.input_ids, ap, 4, target.mask_token_id))
        with torch.no_grad():
            part = state.drafter(feats, noise, make_layout(batch.position_ids, batch.doc_ids, ap, av, 4))
        torch.testing.assert_close(part.view(len(keep), 4, -1), whole[keep], rtol=1e-5, atol=1e-5)


def test_every_piece_size_drafts_the_same_tokens_in_their_places(full_target):
    """Rows and anchors split unevenly (3 rows of 5 anchors: pieces of one anchor, of 2 + 2 + 1 anchors, of 2 + 1
    whole rows) draft exactly what the whole batch drafts."""
    from trainer.data.batching import StaticBatch

    parts = [two_doc_batch(seed=s) for s in (0, 1, 2)]
    batch = StaticBatch(**{f: torch.cat([getattr(b, f) for b in parts]) for f in StaticBatch.__dataclass_fields__})
    state = make_state(full_target, block_size=4, seed=5)
    feats, _ = full_target.features_and_greedy(batch.input_ids, batch.position_ids, batch.doc_ids)
    H, V, S = state.drafter.cfg.num_attention_heads, full_target.embed_tokens.weight.shape[0], batch.input_ids.shape[1]

    def cost(rows, n):
        return rows * n * 4 * (H * (S + n * 4) + V)

    whole = drafted_tokens(full_target, state.drafter, batch, feats, 4)
    assert eval_chunks(3, 5, S, 4, H, V) == (3, 5) and len(set(whole.flatten().tolist())) > 3
    for elements, pieces in ((1, (1, 1)), (cost(1, 2), (1, 2)), (cost(2, 5), (2, 5))):
        assert eval_chunks(3, 5, S, 4, H, V, elements) == pieces
        assert torch.equal(drafted_tokens(full_target, state.drafter, batch, feats, 4, elements=elements), whole)


def test_evaluation_in_one_anchor_pieces_gives_the_same_acceptance(full_target):
    batch = two_doc_batch()
    state = make_state(full_target, block_size=4, seed=5)
    with torch.no_grad():
        whole, valid = block_acceptance(full_target, state.drafter, batch, 4)
        pieces, valid_p = block_acceptance(full_target, state.drafter, batch, 4, elements=1)
        oracle, _ = block_acceptance(full_target, OracleDrafter(full_target, batch), batch, 4, elements=1)
    assert torch.equal(pieces, whole) and torch.equal(valid_p, valid)
    assert oracle[0, :4].tolist() == [3, 3, 3, 3]  # each piece lands in its own anchors' places


def test_an_export_config_missing_a_field_is_one_clear_error():
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="needs the field 'dflash_config'"):
        ExportConfig.from_json({"hidden_size": 8}, "x/config.json")


def other_tools_config() -> dict:
    """A DFlash drafter config as a transformers-5 tool writes it: rope_parameters only, layer_types, the block
    size only inside dflash_config, no head_dim."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "rms_norm_eps": 1e-6,
            "layer_types": ["full_attention", "full_attention"], "vocab_size": 177,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
            "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 3], "block_size": 16,
                              "num_target_layers": 6}}


def test_a_drafter_saved_by_another_tool_is_read():
    cfg = ExportConfig.from_json(other_tools_config())
    assert (cfg.drafter.rope_theta, cfg.drafter.head_dim, cfg.block_size, cfg.num_target_layers) == (5e5, 16, 16, 6)
    assert ExportConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("change, needle", [
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer types"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window=None"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "RoPE scaling 'yarn'"),
])
def test_what_the_drafter_cannot_honour_is_refused_in_one_line(change, needle):
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        ExportConfig.from_json({**other_tools_config(), **change})


def test_export_round_trip_matches_the_drafter(tmp_path, target):
    state = make_state(target, block_size=4)
    cfg = ExportConfig(drafter=state.drafter.cfg, block_size=4, target_layer_ids=tuple(target.layer_ids),
                       num_target_layers=6, mask_token_id=target.mask_token_id, vocab_size=177,
                       max_position_embeddings=4096, dtype="float32")
    assert ExportConfig.from_json(cfg.to_json()) == cfg
    export_drafter(tmp_path / "export", state.drafter, cfg, dtype=torch.float32)
    loaded, saved_cfg = load_exported(tmp_path / "export")
    assert saved_cfg == cfg and not (tmp_path / "export.tmp").exists()
    batch = two_doc_batch()
    a = drafter_hidden(state, batch)
    state.drafter = loaded
    assert torch.equal(drafter_hidden(state, batch), a)


def test_static_buffers_and_grads_keep_their_storage(target):
    """Capture-friendliness (what StepGraph relies on): the step reads fixed input buffers, filled in place, and its
    micro-steps accumulate into fixed .grad buffers."""
    state = make_state(target, block_size=4)
    batch_dev = two_doc_batch()
    ptrs = [t.data_ptr() for t in batch_dev.tensors().values()]
    grad_ptrs = None
    for seed in range(3):
        outs = []
        for _ in range(2):
            batch_dev.copy_(two_doc_batch(seed=seed))
            outs.append(forward_backward(state, batch_dev, 0.5))
            now = [p.grad.data_ptr() for p in state.drafter.parameters()]
            grad_ptrs = grad_ptrs or now
            assert now == grad_ptrs
        assert torch.equal(outs[0].loss_, outs[1].loss_)
        optimizer_step(state)
        state.optimizer.zero_grad(set_to_none=False)
    assert [t.data_ptr() for t in batch_dev.tensors().values()] == ptrs
    assert torch.equal(batch_dev.input_ids, two_doc_batch(seed=2).input_ids)


def _export_of(target, out):
    state = make_state(target, block_size=4)
    return export_drafter(out, state.drafter, ExportConfig.of(state.drafter.cfg, target, 4), dtype=torch.float32)


def test_an_export_is_refused_against_a_target_of_another_shape(tmp_path, target, tiny_target_dir):
    from trainer.errors import ConfigError
    from trainer.export import load_pair
    from trainer.tiny import build_tiny_target

    export = _export_of(target, tmp_path / "export")
    deeper = build_tiny_target(tmp_path / "deeper", num_layers=8, train_steps=0)
    vocab = target.embed_tokens.weight.shape[0]
    with pytest.raises(ConfigError) as e:
        load_pair(export, deeper, "cpu")
    assert str(e.value) == (f"the drafter {export} was trained on a target of 6 layers, hidden size 64, vocabulary "
                            f"{vocab}, but the target {deeper} has 8 layers, hidden size 64, vocabulary {vocab}: "
                            "evaluate it with the target it was trained on")
    _target, _drafter, ecfg = load_pair(export, tiny_target_dir, "cpu")  # the one it was trained on
    assert ecfg.num_target_layers == 6


def test_eval_on_a_file_of_malformed_lines_is_a_data_error_not_tau_none(tmp_path, target, tiny_target_dir):
    from tests.trainer.test_cli import imported, run_cli
    from trainer.errors import DataError
    from trainer.eval import evaluate_export

    export = _export_of(target, tmp_path / "export")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n" * 5)
    with pytest.raises(DataError, match="bad.jsonl"):
        evaluate_export(export, tiny_target_dir, bad)
    p = run_cli("eval", "--drafter", str(export), "--target", str(tiny_target_dir), "--data", str(bad),
                flags=("-X", "importtime"))
    assert p.returncode == 3 and "tau" not in p.stdout and "torch" not in imported(p.stderr), p.stderr[-2000:]


def test_export_of_a_run_trained_with_cuda_only_settings_runs_on_the_cpu(tmp_path, tiny_target_dir):
    """`trainer export` rebuilds the drafter on the CPU: a run recorded with the pipeline, nccl, a captured step
    and flex attention (what a GPU run's config.json says) exports the same bytes its training wrote."""
    import json

    from tests.trainer.conftest import small_cfg
    from trainer.train import export_run, train

    run = tmp_path / "run"
    train(small_cfg(tiny_target_dir, "optim.max_steps=2"), run, environ={})
    written = (run / "export" / "model.safetensors").read_bytes()
    recorded = json.loads((run / "config.json").read_text())
    recorded.update(device="auto", pipeline={**recorded["pipeline"], "enabled": True, "target_device": "cuda:local"},
                    dist={"backend": "nccl"})
    recorded["step"].update(mode="compile+graph", attn="flex", head_fp8=True)
    recorded["model"]["target_fp8"] = True
    (run / "config.json").write_text(json.dumps(recorded))
    (run / "export" / "model.safetensors").unlink()
    assert export_run(run) == run / "export"
    assert (run / "export" / "model.safetensors").read_bytes() == written
